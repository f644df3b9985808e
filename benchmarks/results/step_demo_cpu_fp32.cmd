# The shipped step-11800 demo model, 2 cores, quiet machine, one thread per system, 1 round (scratch/s4_bench.sh, session 4).
python benchmarks/step_bench.py --model demo --audio nemo_serve/assets/demo/utterances/manifest.jsonl --context-right 3 --batch-sizes 1,16,32 --seconds 10 --rounds 1 --out benchmarks/results/step_demo_r3_cpu_fp32.json
python benchmarks/step_bench.py --model demo --audio nemo_serve/assets/demo/utterances/manifest.jsonl --context-right 13 --batch-sizes 1,16,32 --seconds 10 --rounds 1 --out benchmarks/results/step_demo_r13_cpu_fp32.json
