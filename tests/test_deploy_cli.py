"""What the chart runs matches the real ``infernex`` command line and settings: every InferNex
container's args parse with the CLI's own parser (commands, flags, types, required options), and
the generated settings file validates as :class:`infernex.settings.Settings`."""

from __future__ import annotations

import importlib
import json

import pytest
import typer.main
import yaml

from deploytools import EXAMPLE_VALUES, by_kind, one, render

ALL_VALUES = [None, *EXAMPLE_VALUES]


def _infernex_containers(docs: list[dict]):
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            continue
        spec = doc["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            if "/infernex:" in c["image"]:
                yield doc, c


def _root():
    """The CLI's click command tree, and the click module it is built on (typer may vendor it)."""
    from infernex.cli import app

    root = typer.main.get_command(app)
    base = next(c for c in type(root).__mro__
                if c.__module__.split(".")[0] in ("click", "typer") and not c.__module__.startswith("typer.core"))
    return root, importlib.import_module(base.__module__.rsplit(".", 1)[0])


_, click = _root()


def _parse(args: list[str]) -> list[str]:
    """Parse ``infernex ARGS`` with the real command tree; return the command path."""
    root, _ = _root()
    ctx = click.Context(root, info_name="infernex")
    cmd, rest, path = root, list(args), []
    while hasattr(cmd, "get_command") and rest and not rest[0].startswith("-"):
        name = rest.pop(0)
        sub = cmd.get_command(ctx, name)
        if sub is None:
            raise click.UsageError(f"no command {' '.join(path + [name])!r}")
        path.append(name)
        cmd = sub
        if hasattr(cmd, "get_command") and rest and not rest[0].startswith("-"):
            ctx = click.Context(cmd, info_name=name, parent=ctx)
    cmd.make_context(" ".join(["infernex", *path]), rest, parent=ctx)
    return path


@pytest.mark.parametrize("values", ALL_VALUES)
def test_container_args_parse_with_the_real_cli(values):
    docs = render(values)
    seen = set()
    for doc, c in _infernex_containers(docs):
        where = f"{doc['kind']}/{doc['metadata']['name']} container {c['name']}"
        try:
            path = _parse(c["args"])
        except click.ClickException as exc:
            pytest.fail(f"{where}: infernex {' '.join(c['args'])}: {exc.format_message()}")
        seen.add(" ".join(path))
    expected = {"router", "indexer", "diagnose", "collect devices", "sla-sink", "streams apply",
                "bridge vllm-kv", "collect metrics"}
    assert expected <= seen, f"not deployed: {expected - seen}"


def test_cli_parse_rejects_unknown_flags():
    with pytest.raises(click.ClickException):
        _parse(["indexer", "--no-such-flag", "1"])
    with pytest.raises(click.ClickException):
        _parse(["collect", "devices", "--node", "n"])  # --source is required
    assert _parse(["bridge", "vllm-kv", "--endpoint", "tcp://127.0.0.1:5557", "--pod", "p", "--model", "m"]) == [
        "bridge", "vllm-kv"]


@pytest.mark.parametrize("values", ALL_VALUES)
def test_generated_settings_validate(values, monkeypatch):
    from infernex.settings import Settings

    for key in [k for k in __import__("os").environ if k.startswith("INFERNEX_")]:
        monkeypatch.delenv(key)
    docs = render(values)
    text = one(docs, "ConfigMap", "infernex-config")["data"]["config.yaml"]
    data = yaml.safe_load(text)
    settings = Settings(**data)
    assert settings.router.host == "0.0.0.0" and settings.router.kubernetes.enabled
    assert settings.indexer.http_host == "0.0.0.0"
    assert settings.diagnosis.metrics_host == "0.0.0.0"
    # The router discovers exactly the pods the InferencePool selects, on the pool's port.
    pool = by_kind(docs, "InferencePool")[0]
    assert settings.router.kubernetes.port == pool["spec"]["targetPorts"][0]["number"]
    assert settings.router.pool == pool["metadata"]["name"]
    selector = dict(kv.split("=", 1) for kv in settings.router.kubernetes.label_selector.split(","))
    engines = [d for d in by_kind(docs, "Deployment")
               if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "engine"]
    assert engines and all(
        all(d["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in selector.items()) for d in engines)
    # Every control-plane container reads this file.
    for doc, c in _infernex_containers(docs):
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert env["INFERNEX_CONFIG"] == "/etc/infernex/settings/config.yaml"
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        assert mounts.get("/etc/infernex/settings") == "infernex-config", doc["metadata"]["name"]


def test_pd_example_planner_pool_is_valid():
    """The PD example's planner pool parses as the planner's own config and targets real Deployments."""
    from infernex.settings import Settings

    docs = render("values-pd-2p2d.yaml")
    data = yaml.safe_load(one(docs, "ConfigMap", "infernex-config")["data"]["config.yaml"])
    settings = Settings(**data)
    pools = settings.sla.planner.pools
    assert len(pools) == 1 and pools[0].roles == ["prefill", "decode"]
    names = {d["metadata"]["name"] for d in by_kind(docs, "Deployment")}
    for role, target in pools[0].kubernetes.items():
        assert target.name in names, f"planner target {role} -> {target.name} is not deployed"
    assert pools[0].load_profile().prefill_throughput(1024) > 0
    # embedded chDB: the planner runs in the sink's process, not as a second chDB owner
    sink = one(docs, "StatefulSet", "infernex-sla-sink")
    assert "--planner" in sink["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "infernex-planner"]
    json.dumps(data)  # plain data only


def test_pd_example_custom_strategy_profile_loads(tmp_path):
    """pluginsCustomConfig is mounted where the settings point, and the router accepts it."""
    from infernex.settings import Settings
    from router.profiles import load_strategy

    docs = render("values-pd-2p2d.yaml")
    settings = Settings(**yaml.safe_load(one(docs, "ConfigMap", "infernex-config")["data"]["config.yaml"]))
    mount_dir, file_name = settings.router.strategy.rsplit("/", 1)
    router = one(docs, "Deployment", "infernex-router")
    c = router["spec"]["template"]["spec"]["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["profiles"] == mount_dir
    volumes = {v["name"]: v for v in router["spec"]["template"]["spec"]["volumes"]}
    profiles = one(docs, "ConfigMap", volumes["profiles"]["configMap"]["name"])["data"]
    path = tmp_path / file_name
    path.write_text(profiles[file_name])
    strategy = load_strategy(str(path))
    assert strategy.pd  # a prefill/decode profile
    with pytest.raises(ValueError):
        load_strategy(str(tmp_path / "missing.yaml"))


def test_router_auth_from_secret(monkeypatch, tmp_path):
    from infernex.settings import Settings

    for key in [k for k in __import__("os").environ if k.startswith("INFERNEX_")]:
        monkeypatch.delenv(key)
    docs = render("values-aggregated.yaml")
    router = one(docs, "Deployment", "infernex-router")
    spec = router["spec"]["template"]["spec"]
    c = spec["containers"][0]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["auth"]["secret"]["secretName"] == "infernex-router-keys"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    admin = next(e for e in c["env"] if e["name"] == "INFERNEX_ROUTER__ADMIN_KEY")
    assert admin["valueFrom"]["secretKeyRef"] == {"name": "infernex-router-keys", "key": "admin-key"}
    # The settings point at the mounted key file; the env var fills in the admin key on top.
    data = yaml.safe_load(one(docs, "ConfigMap", "infernex-config")["data"]["config.yaml"])
    assert data["router"]["api_keys_file"] == f"{mounts['auth']}/api-keys"
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(data))
    monkeypatch.setenv("INFERNEX_CONFIG", str(cfg))
    monkeypatch.setenv("INFERNEX_ROUTER__ADMIN_KEY", "s3cret")
    settings = Settings()
    assert settings.router.admin_key.get_secret_value() == "s3cret"
    assert str(settings.router.api_keys_file) == f"{mounts['auth']}/api-keys"
    assert settings.router.rate_limit_rps == 20
    assert "s3cret" not in repr(settings)


KAFKA_SETS = ["kafkaExport.enabled=true", "kafkaExport.bootstrap=kafka.data:9093",
              "kafkaExport.security.protocol=SASL_SSL", "kafkaExport.security.saslMechanism=SCRAM-SHA-512",
              "kafkaExport.security.username=infernex", "kafkaExport.security.passwordSecret.name=kafka-creds",
              "kafkaExport.security.caFile=/etc/ssl/certs/ca-certificates.crt"]


def test_kafka_export_from_chart_values():
    """kafkaExport values render an exporter whose args parse with the real CLI, with its
    password from a Secret (never in the args), probes on its metrics port, and a metrics Service."""
    from deploytools import render

    docs = render(None, sets=KAFKA_SETS)
    deps = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-kafka-export")]
    assert len(deps) == 1
    c = deps[0]["spec"]["template"]["spec"]["containers"][0]
    assert _parse(c["args"]) == ["export", "kafka"]
    args = c["args"]
    assert args[args.index("--security-protocol") + 1] == "SASL_SSL"
    assert args[args.index("--sasl-mechanism") + 1] == "SCRAM-SHA-512"
    assert args[args.index("--metrics-port") + 1] == "9107"
    env = {e["name"]: e for e in c["env"]}
    assert env["INFERNEX_KAFKA_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "kafka-creds", "key": "password"}
    assert not any("password" in a.lower() and a != "--sasl-password-env" for a in args)
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert not [d for d in render(None) if d["metadata"]["name"].endswith("-kafka-export")]  # off by default


def test_kafka_export_sasl_without_secret_is_refused():
    from deploytools import render

    with pytest.raises(AssertionError, match="SASL needs saslMechanism, username and passwordSecret.name"):
        render(None, sets=KAFKA_SETS[:4])
