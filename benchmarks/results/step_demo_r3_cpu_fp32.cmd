# The step-1800 demo model (sha256 1ffb01e3a886..., as committed in d3ad873), on 2 shared cores
# (load average 5.6 at start: a training run and another benchmark were running), 1 thread each.
git show d3ad873:nemo_serve/assets/demo/demo.nemo > /tmp/demo_1800.nemo
python benchmarks/step_bench.py --model /tmp/demo_1800.nemo --audio nemo_serve/assets/demo/utterances/manifest.jsonl --context-right 3 --batch-sizes 1,16,32 --seconds 10 --out scratch/step_demo_r3.json
cp scratch/step_demo_r3.json benchmarks/results/step_demo_r3_cpu_fp32.json; cp scratch/step_demo_r3.png benchmarks/results/step_demo_r3_cpu_fp32.png
