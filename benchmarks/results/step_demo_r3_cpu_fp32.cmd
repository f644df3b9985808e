# The shipped step-6000 demo model (commit 98b7b3e), 2 cores, quiet machine, one thread per system, 1 round.
python benchmarks/step_bench.py --model demo --audio nemo_serve/assets/demo/utterances/manifest.jsonl --context-right 3 --batch-sizes 1,16,32 --seconds 10 --rounds 1 --out scratch/step_demo_r3_cpu_fp32.json
cp scratch/step_demo_r3_cpu_fp32.json scratch/step_demo_r3_cpu_fp32.png benchmarks/results/
