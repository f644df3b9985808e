"""The deployment files in deploy/ say what nemo-serve understands: no server, no model.

- deploy/nemo-serve.service (systemd): ExecStart's arguments parse with nemo-serve's own parser
  and validate as its Settings; its NEMO_SERVE_* variables are real settings; SIGTERM reaches only
  the main process (KillMode=mixed: a front end signalled twice quits without draining);
  TimeoutStopSec is longer than the drain; a failure restarts, a usage error (exit 2) does not.
- deploy/kubernetes.yaml: the container command (exec form, nemo-serve as PID 1) parses and
  validates the same way; one GPU per pod and a CUDA device; readiness on /readyz and liveness
  on /healthz, routes the app serves, on the port the server binds; the grace period is longer
  than the preStop sleep plus the drain; the Service selects the pods; /dev/shm holds the audio
  rings when there are front-end processes.
- deploy/ray_serve.yaml: Ray Serve's config format (validated by Ray's schema where ray is
  installed); the import path names a function of nemo_serve.ray_serve; every arg is one that
  app_builder reads or a NEMO_SERVE_* setting; graceful_shutdown_timeout_s is longer than the drain.
"""

from __future__ import annotations

import ast
import importlib
import re
import shlex
import types
from pathlib import Path

import pytest
import yaml

from nemo_serve import cli
from nemo_serve.config import ENV_PREFIX, Settings
from nemo_serve.core.engine_core import ring_layout
from nemo_serve.core.supervisor import default_frontends
from nemo_serve.server.app import create_app

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SAMPLE_RATE = 16000  # every model nemo-serve serves takes 16 kHz audio


# ----------------------------------------------------------------------------- helpers


def parse_flags(argv: list[str], env: dict[str, str], where: str) -> Settings:
    """argv through nemo-serve's own parser, then Settings from it and env, as cli.main does."""
    parser = cli.build_parser()
    known = {s for action in parser._actions for s in action.option_strings}
    for token in argv:  # spelled out in full: argparse would also take an abbreviation
        if token.startswith("-"):
            assert token.split("=", 1)[0] in known, f"{where}: {token} is not one of nemo-serve's flags"
    try:
        args = parser.parse_args(argv)
    except SystemExit:  # argparse printed the reason (unknown flag, bad choice) to stderr
        pytest.fail(f"{where}: nemo-serve's parser refuses {argv}")
    for name in env:
        assert name.startswith(ENV_PREFIX), f"{where}: {name} is not a NEMO_SERVE_* variable"
        field = name[len(ENV_PREFIX) :].lower()
        assert field in Settings.model_fields, f"{where}: {name} is no nemo-serve setting"
    return Settings.from_sources(vars(args), env)


def served_get_paths(settings: Settings) -> set[str]:
    """The app's GET routes (create_app only declares them: no engine, no model needed)."""
    app = create_app(types.SimpleNamespace(settings=settings))
    return {r.path for r in app.routes if "GET" in (getattr(r, "methods", None) or ())}


def parse_systemd_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """systemd's unit syntax: [Section], Key=value (a key may repeat), # and ; comments,
    a trailing backslash continues the line."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    logical, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "the unit ends inside a continued line"
    for line in logical:
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"not a unit line: {line!r}"
        key, value = line.split("=", 1)
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def systemd_seconds(value: str) -> float:
    """A systemd time span: 90, 90s, 2min, 1min 30s."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        assert unit in units, f"time unit {unit!r} in {value!r}"
        total += float(number) * units[unit]
    assert total > 0, value
    return total


def k8s_bytes(q: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(q))
    assert m, f"quantity {q!r}"
    mult = {None: 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    return float(m.group(1)) * mult[m.group(2)]


def k8s_cpus(q) -> float:
    q = str(q)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


# ----------------------------------------------------------------------------- systemd


def test_systemd_unit():
    unit = parse_systemd_unit((DEPLOY / "nemo-serve.service").read_text())
    service = {k: v[-1] for k, v in unit["Service"].items()}  # the last assignment wins...
    env = {}
    for line in unit["Service"].get("Environment", []):  # ...except Environment=, which adds up
        for item in shlex.split(line):
            name, value = item.split("=", 1)
            env[name] = value
    assert len(unit["Service"]["ExecStart"]) == 1
    argv = shlex.split(service["ExecStart"])
    assert Path(argv[0]).name == "nemo-serve" and argv[0].startswith("/"), argv[0]
    venv = env.get("VIRTUAL_ENV")
    assert venv and argv[0] == f"{venv}/bin/nemo-serve", "ExecStart is not the venv's nemo-serve"
    assert env["PATH"].split(":")[0] == f"{venv}/bin"

    settings = parse_flags(argv[1:], {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}, "ExecStart")
    assert settings.host == "0.0.0.0"  # a service is for other machines

    assert service.get("Type", "simple") in ("simple", "exec")  # nemo-serve neither forks nor sd_notify()s
    assert service.get("KillSignal", "SIGTERM") == "SIGTERM"  # what starts the drain
    assert service.get("KillMode") == "mixed", "SIGTERM must go to the supervisor only"
    assert systemd_seconds(service["TimeoutStopSec"]) > settings.drain_timeout_s
    assert service["Restart"] in ("on-failure", "always")
    assert str(cli.EXIT_USAGE) in service.get("RestartPreventExitStatus", "").split()
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


# ----------------------------------------------------------------------------- Kubernetes


def _k8s():
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert sorted(by_kind) == ["Deployment", "Service"]
    return by_kind["Deployment"], by_kind["Service"]


def test_kubernetes_command_gpu_and_shared_memory():
    deployment, _ = _k8s()
    pod = deployment["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert "args" not in c
    command = c["command"]
    assert command[0] == "nemo-serve", "exec form with nemo-serve as PID 1, or SIGTERM does not reach it"
    env = {e["name"]: e.get("value", "x") for e in c.get("env", [])}  # a Secret's value: a stand-in
    settings = parse_flags(command[1:], env, "container command")
    assert settings.host == "0.0.0.0"

    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert settings.device.startswith("cuda") and settings.devices is None

    # --frontends' default counts the node's CPUs, not the pod's: it must be given, and fit the request
    assert settings.frontends is not None
    assert settings.frontends <= default_frontends(int(k8s_cpus(c["resources"]["requests"]["cpu"])))

    # front ends and core share the audio rings through /dev/shm
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert vol["emptyDir"]["medium"] == "Memory"
    need = ring_layout(settings, SAMPLE_RATE).nbytes
    assert k8s_bytes(vol["emptyDir"]["sizeLimit"]) >= need, f"/dev/shm smaller than the rings' {need} bytes"


def test_kubernetes_probes_and_drain():
    deployment, service = _k8s()
    pod = deployment["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value", "x") for e in c.get("env", [])}
    settings = parse_flags(c["command"][1:], env, "container command")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert settings.port in ports.values()

    served = served_get_paths(settings)
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz"), ("startupProbe", "/healthz")):
        get = c[probe]["httpGet"]
        assert get["path"] == path, f"{probe} on {get['path']}"
        assert get["path"] in served, f"the app serves no GET {get['path']}"
        assert ports.get(get["port"], get["port"]) == settings.port, f"{probe} on another port"

    pre_stop = c["lifecycle"]["preStop"]
    sleep_s = float(pre_stop["exec"]["command"][-1]) if "exec" in pre_stop else float(pre_stop["sleep"]["seconds"])
    grace = pod["terminationGracePeriodSeconds"]
    assert grace > sleep_s + settings.drain_timeout_s, f"grace {grace} s <= preStop {sleep_s} + drain {settings.drain_timeout_s}"

    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    for p in service["spec"]["ports"]:
        assert ports.get(p["targetPort"], p["targetPort"]) == settings.port


# ----------------------------------------------------------------------------- Ray Serve


def _ray_app():
    cfg = yaml.safe_load((DEPLOY / "ray_serve.yaml").read_text())
    (app,) = cfg["applications"]
    return cfg, app


def _app_builder_keys(func_name: str) -> set[str]:
    """The option names the builder reads (`args.get("...")` / `args["..."]`), from its source."""
    tree = ast.parse((ROOT / "nemo_serve" / "ray_serve.py").read_text())
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert func_name in funcs, f"nemo_serve.ray_serve has no function {func_name}"
    keys = set()
    for node in ast.walk(funcs[func_name]):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                keys.add(node.args[0].value)
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            keys.add(node.slice.value)
    return keys


def test_ray_serve_config_args_and_drain():
    _, app = _ray_app()
    module, _, attr = app["import_path"].partition(":")
    assert module == "nemo_serve.ray_serve" and attr
    keys = _app_builder_keys(attr)
    args = app.get("args", {})
    env = {k: str(v) for k, v in args.items() if k.startswith(ENV_PREFIX)}
    unknown = set(args) - set(env) - keys
    assert not unknown, f"args {sorted(unknown)} are read by neither {attr} nor Settings"
    settings = parse_flags([], env, "ray_serve.yaml args")
    assert float(args["graceful_shutdown_timeout_s"]) > settings.drain_timeout_s
    assert float(args.get("gpus", 0)) == 1  # one GPU per replica


def test_ray_serve_config_with_ray():
    pytest.importorskip("ray")
    from ray.serve.schema import ServeDeploySchema

    cfg, app = _ray_app()
    ServeDeploySchema.model_validate(cfg)
    module, _, attr = app["import_path"].partition(":")
    builder = getattr(importlib.import_module(module), attr)
    assert callable(builder)
    bound = builder(app["args"])  # binds the deployment with its options; starts nothing
    assert type(bound).__name__ == "Application"
