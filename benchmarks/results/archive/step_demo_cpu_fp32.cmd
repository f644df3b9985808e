# The shipped step-14800 demo model, 2 cores, one thread per system, 3 rounds (median per system and batch), session 5.
python benchmarks/step_bench.py --model demo --audio nemo_serve/assets/demo/utterances/manifest.jsonl --context-right 3 --batch-sizes 1,16,32 --seconds 10 --rounds 3 --out benchmarks/results/step_demo_r3_cpu_fp32.json
python benchmarks/step_bench.py --model demo --audio nemo_serve/assets/demo/utterances/manifest.jsonl --context-right 13 --batch-sizes 1,16,32 --seconds 10 --rounds 3 --out benchmarks/results/step_demo_r13_cpu_fp32.json
