"""benchmarks/gpu/run_gpu.sh on CPU with a stand-in `python3`: it installs carried wheels, sets the
cache and passes the budget, diagnoses a failed preflight, profiles first on a GPU, runs every phase
in order within eight files, and skips what no longer fits."""

from __future__ import annotations

from .helpers_gpu_run import REPO, _archived, _fake_python, _run_sh


def test_run_gpu_sh_installs_carried_wheels_and_runs_the_bench(tmp_path):
    """The wrapper: the image's packages are listed before anything is carried in, wheels go to
    /tmp/site with pip --no-index, the cache and PYTHONPATH are set, gpu_bench.py gets the model,
    device, dtype, budget and extra options."""
    fake, log = _fake_python(tmp_path)
    r, carry, out = _run_sh(tmp_path, fake, "--modes", "3")
    assert r.returncode == 0, r.stdout + r.stderr
    calls = log.read_text().splitlines()
    first_list = next(i for i, c in enumerate(calls) if c.startswith("-m pip list"))
    install = next(i for i, c in enumerate(calls) if c.startswith("-m pip install -q --no-index --no-deps"))
    assert first_list < install and "/tmp/site" not in calls[first_list]  # the image alone
    assert "--target /tmp/site" in calls[install] and str(carry / "wheels" / "x-1-py3-none-any.whl") in calls[install]
    bench = [c for c in calls if "gpu_bench.py" in c]
    assert len(bench) == 1
    args = bench[0].split(" | ")[0].split()
    assert args[args.index("--model") + 1] == "nemotron-0.6b"
    assert args[args.index("--device") + 1] == "cpu" and args[args.index("--dtype") + 1] == "fp32"
    assert 90 <= int(args[args.index("--budget-s") + 1]) <= 100
    assert args[-2:] == ["--modes", "3"]
    assert "/tmp/site" in bench[0] and str(REPO) in bench[0] and f"CACHE={carry / 'cache'}" in bench[0]
    assert (out / "run.log").exists() and "./env.txt" in _archived(out)  # packed: OUT keeps 8 files at most
    assert not any("diagnose.py" in c for c in calls)  # the bench passed: nothing to diagnose


def test_run_gpu_sh_diagnoses_a_failed_preflight_and_measures_with_what_works(tmp_path):
    """gpu_bench.py exits 4 (preflight failed): diagnose.py runs, and the bench runs again with the
    environment of the variant it chose, on what is left of the budget."""
    fake, log = _fake_python(tmp_path, (
        'case "$*" in\n'
        '  *gpu_bench.py*) [ -n "$NEMO_SERVE_ENCODER_GRAPHS" ] && exit 0; exit 4;;\n'
        '  *diagnose.py*) echo "CHOSEN NEMO_SERVE_ENCODER_GRAPHS=0"; exit 0;;\n'
        "esac\n"
    ))
    r, _, out = _run_sh(tmp_path, fake)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = [c for c in log.read_text().splitlines() if "gpu_bench.py" in c or "diagnose.py" in c]
    assert [c.split(".py")[0].rsplit("/", 1)[-1] for c in calls] == ["gpu_bench", "diagnose", "gpu_bench"]
    assert calls[0].endswith("ENC=") and calls[2].endswith("ENC=0")
    assert "diagnosis: NEMO_SERVE_ENCODER_GRAPHS=0" in (out / "run.log").read_text()


def test_run_gpu_sh_stops_when_no_variant_works(tmp_path):
    fake, log = _fake_python(tmp_path, (
        'case "$*" in\n  *gpu_bench.py*) exit 4;;\n  *diagnose.py*) echo "CHOSEN NONE"; exit 5;;\nesac\n'
    ))
    r, _, _ = _run_sh(tmp_path, fake)
    assert r.returncode == 4
    assert sum("gpu_bench.py" in c for c in log.read_text().splitlines()) == 1


def test_run_gpu_sh_profiles_first_on_a_gpu(tmp_path):
    """DEVICE=cuda: profile_step.py runs before gpu_bench.py, into OUT/profile, bounded by PROFILE_S;
    the bench gets what is left of BUDGET_S. On CPU (the tests above) no profile runs unless asked."""
    fake, log = _fake_python(tmp_path, 'case "$*" in *profile_step.py*) sleep 2;; esac\n')
    r, _, out = _run_sh(tmp_path, fake, env={"DEVICE": "cuda", "PROFILE_S": "60", "BUDGET_S": "100"})
    assert r.returncode == 0, r.stdout + r.stderr
    calls = [c.split(" | ")[0].split() for c in log.read_text().splitlines() if ".py" in c]
    assert [next(a for a in c if a.endswith(".py")).rsplit("/", 1)[-1] for c in calls] == [
        "profile_step.py", "gpu_bench.py", "server_capacity.py", "decide.py"]  # the last two: on by default on CUDA
    prof, bench = calls[:2]
    assert prof[prof.index("--out") + 1] == f"{out}/profile" and prof[prof.index("--budget-s") + 1] == "40"
    assert prof[prof.index("--device") + 1] == "cuda" and prof[prof.index("--model") + 1] == "nemotron-0.6b"
    assert 90 <= int(bench[bench.index("--budget-s") + 1]) <= 98  # the profile's seconds came off the budget
    assert "profile_step.py exit 0" in (out / "run.log").read_text()


def test_run_gpu_sh_profile_only(tmp_path):
    """PROFILE_ONLY=1: the profile runs, its exit status is the wrapper's, the bench does not run."""
    fake, log = _fake_python(tmp_path, 'case "$*" in *profile_step.py*) exit 1;; esac\n')
    r, _, _ = _run_sh(tmp_path, fake, env={"DEVICE": "cuda", "PROFILE_ONLY": "1"})
    assert r.returncode == 1, r.stdout + r.stderr
    ran = [c for c in log.read_text().splitlines() if ".py" in c]
    assert len(ran) == 1 and "profile_step.py" in ran[0]


def test_run_gpu_sh_runs_every_phase_in_order_boxed_within_eight_files(tmp_path):
    """On CUDA: profile, bench, server (picows imports: --fast-ws; its budget cut to what WALL_S leaves),
    decide, in that order; every phase's files land in OUT, the secondary ones packed, so OUT never
    holds more than the device tool's 8 files. Seen to fail with the previous run_gpu.sh (no server
    phase by default, no decide, env.txt and the trace loose in OUT: 10 files)."""
    fake, log = _fake_python(tmp_path, (
        'out=$(echo "$*" | sed -n "s/.*--out \\([^ ]*\\).*/\\1/p")\n'
        'case "$*" in\n'
        '  *profile_step.py*) mkdir -p $out; touch $out/profile.json $out/summary.txt $out/trace_r0.json.gz;;\n'
        '  *gpu_bench.py*) touch $out/results.jsonl;;\n'
        '  *server_capacity.py*) touch $out/server_capacity.json $out/server_capacity.server.log;;\n'
        '  *decide.py*) touch $2/decision.json;;\n'
        "esac\n"
    ))
    r, _, out = _run_sh(tmp_path, fake, env={"DEVICE": "cuda", "PROFILE_S": "30", "BUDGET_S": "60", "WALL_S": "100",
                                               "SERVER_LOAD_S": "90"})  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    calls = [c.split(" | ")[0].split() for c in log.read_text().splitlines() if ".py" in c or "import picows" in c]
    names = [next((a for a in c if a.endswith(".py")), "picows?").rsplit("/", 1)[-1] for c in calls]
    assert names == ["profile_step.py", "gpu_bench.py", "picows?", "server_capacity.py", "decide.py"], names
    server = calls[3]
    assert "--fast-ws" in server and 70 <= int(server[server.index("--budget-s") + 1]) <= 75  # 100 - elapsed - 25
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["decision.json", "extra.tar.gz", "profile/profile.json", "profile/summary.txt",
                     "results.jsonl", "run.log", "server_capacity.json"], files
    assert sorted(_archived(out)) == [".", "./env.txt", "./server_capacity.server.log", "./trace_r0.json.gz"]


def test_run_gpu_sh_skips_picows_and_a_server_phase_that_no_longer_fits(tmp_path):
    """picows does not import (not carried): the server phase runs uvicorn's /ws only; with under 40 s
    of WALL_S left it does not start at all, and decide still runs."""
    fake, log = _fake_python(tmp_path, 'case "$*" in *"import picows"*) exit 1;; esac\n')
    r, _, out = _run_sh(tmp_path, fake, env={"DEVICE": "cuda", "PROFILE": "0", "WALL_S": "100"})
    assert r.returncode == 0, r.stdout + r.stderr
    server = next(c for c in log.read_text().splitlines() if "server_capacity.py" in c)
    assert "--fast-ws" not in server and "picows does not import" in (out / "run.log").read_text()
    late = tmp_path / "late"
    late.mkdir()
    fake, log = _fake_python(late, "")
    r, _, out = _run_sh(late, fake, env={"DEVICE": "cuda", "PROFILE": "0", "WALL_S": "50"})
    names = [c for c in log.read_text().splitlines() if ".py" in c]
    assert r.returncode == 0 and not any("server_capacity.py" in c for c in names) and "decide.py" in names[-1], names
    assert "server phase skipped" in (out / "run.log").read_text()
