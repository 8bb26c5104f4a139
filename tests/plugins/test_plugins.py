"""Plugins as users install them: the dummy backend (tests/plugins/polyrl_dummy_backend) is found, listed with
its distribution, selectable by name but never picked implicitly (it is not an accelerator); plugins that fail
in every way (tests/plugins/polyrl_faulty_plugins) are reported while `backends`, `doctor` and `run` keep
working; and each hook is run — a plugin registered in-process contributes a backend, a task and a rollout engine
that a real `polyrl run` uses."""

from __future__ import annotations

import json
from importlib import metadata

import pytest

from polyrl.cli import main as polyrl_main
from polyrl.core import plugins
from polyrl.core.errors import BackendSelectionError, BadInputError
from polyrl.core.plugins import selection

FAULTY = "polyrl-faulty-plugins"


@pytest.fixture
def cli(capsys):
    """``cli(*args) -> (exit code, stdout, stderr)`` of the polyrl command, in-process."""

    def run(*args: str) -> tuple[int, str, str]:
        plugins.reset_active_backend()
        rc = polyrl_main(list(args))
        out, err = capsys.readouterr()
        return rc, out, err

    return run


# --- discovery and listing ------------------------------------------------------------------------------


def test_installed_plugins_are_listed_and_failures_reported_by_the_real_command(site_cli):
    proc = site_cli(["backends", "--json"])
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    by_name = {b["name"]: b for b in data["backends"]}
    assert {"cpu", "cuda", "ascend", "dummy", "dummy2"} <= set(by_name)
    dummy = by_name["dummy"]
    assert (dummy["distribution"], dummy["version"]) == ("polyrl-dummy-backend", "0.0.1")
    assert dummy["available"] is False and dummy["is_accelerator"] is False
    # native_kernels is derived: the dummy names its own attention kernel and leaves logprobs to the reference.
    assert dummy["native_kernels"] == ["varlen_attention"] and dummy["kernels_fallback"] == [
        "logprobs", "linear_logprobs", "experts", "decode_attention", "linear_logprob_loss"]
    assert by_name["cpu"]["distribution"] == "polyrl" and by_name["cpu"]["kernels_fallback"] == []
    failed = {n["name"]: n for n in data["not_loaded"] if n["failed"]}
    assert failed["faulty_import"] == {"name": "faulty_import", "distribution": FAULTY, "failed": True,
                                       "reason": "import failed: ImportError: planted import failure"}
    text = site_cli(["backends"])
    assert text.returncode == 0 and "Traceback" not in text.stderr
    assert "faulty_import" in text.stdout and "FAILED: import failed: ImportError: planted import failure" in text.stdout


def test_autoload_disabled_hides_third_party(with_plugins, monkeypatch, cli):
    monkeypatch.setenv("POLYRL_DISABLE_PLUGIN_AUTOLOAD", "1")
    plugins.reset_registry()
    rc, out, _ = cli("backends", "--json")
    data = json.loads(out)
    assert rc == 0 and "dummy" not in {b["name"] for b in data["backends"]}
    skipped = {n["name"]: n for n in data["not_loaded"]}
    assert skipped["dummy"]["failed"] is False and "autoload is disabled" in skipped["dummy"]["reason"]
    assert skipped["faulty_import"]["failed"] is False  # not even imported


def test_the_plugins_group_loads_like_the_backends_group(with_plugins):
    registry = plugins.get_registry()
    assert "dummy_task" in registry.tasks and "dummy_engine" in registry.rollout_engines
    from polyrl.core.rollout import engine_names

    assert {"hf", "dummy_engine"} <= set(engine_names())


# --- isolation: each failure is reported, the rest works ------------------------------------------------


def test_each_faulty_plugin_is_reported_with_its_distribution_and_one_line(with_plugins, cli):
    rc, out, err = cli("backends", "--json")
    assert rc == 0, err
    data = json.loads(out)
    failed = {n["name"]: n for n in data["not_loaded"] if n["failed"]}
    assert {n["distribution"] for n in failed.values()} == {FAULTY}
    assert failed["faulty_import"]["reason"] == "import failed: ImportError: planted import failure"
    assert failed["faulty_register"]["reason"] == "registration failed: RuntimeError: planted registration failure"
    assert failed["faulty_hook_name"]["reason"].startswith("registration failed: PluginValidationError")
    assert failed["faulty_duplicate"]["reason"] == (
        "registration failed: ValueError: rollout engine 'hf' is already registered by plugin 'cpu'")
    by_name = {b["name"]: b for b in data["backends"]}
    assert "half_registered" not in by_name  # registered, then its plugin failed: dropped
    # detect() raising: listed, unavailable, the error's first line as the reason.
    assert by_name["bad_detect"]["available"] is False
    assert by_name["bad_detect"]["reason"] == "detect() raised RuntimeError: planted detect failure"
    # a kernel path that does not resolve: unavailable with the reason, before any kernel runs.
    bad = by_name["bad_kernel"]
    assert bad["available"] is False
    assert bad["reason"] == ("broken declaration: attention_kernel 'polyrl_faulty_plugins.bad_kernel:varlen_attenton':"
                             " module polyrl_faulty_plugins.bad_kernel has no function 'varlen_attenton'")
    assert bad["problems"] and "warp-drive" in bad["warnings"][0]
    assert by_name["cpu"]["available"] is True and by_name["cpu"]["problems"] == []
    rc, out, _ = cli("backends")
    assert rc == 0 and "PROBLEM attention_kernel" in out and "FAILED: registration failed" in out


def test_selection_skips_broken_accelerators_and_explains_an_explicit_choice(with_plugins):
    # bad_detect and bad_kernel are accelerators: neither crashes nor wins the implicit choice.
    assert selection.resolve_backend().name == "cpu"
    with pytest.raises(BackendSelectionError, match=r"not available: detect\(\) raised RuntimeError: planted detect"):
        selection.resolve_backend("bad_detect")
    with pytest.raises(BackendSelectionError, match="installed but not loaded: import failed: ImportError"):
        selection.resolve_backend("faulty_import")
    with pytest.raises(BackendSelectionError, match="has no function 'varlen_attenton'"):
        selection.resolve_backend("bad_kernel")


def test_doctor_reports_failed_plugins_and_still_checks_the_rest(with_plugins, cli):
    rc, out, err = cli("doctor", "--json")
    assert rc == 1 and "Traceback" not in err
    report = json.loads(out)
    assert report["healthy"] is False
    assert {n["name"] for n in report["not_loaded"] if n["failed"]} == {
        "faulty_import", "faulty_register", "faulty_hook_name", "faulty_duplicate"}
    by_name = {b["name"]: b for b in report["backends"]}
    assert by_name["cpu"]["problems"] == [] and by_name["cpu"]["components"]["torch"]
    assert any("varlen_attenton" in p["message"] for p in by_name["bad_kernel"]["problems"])
    assert by_name["dummy"]["distribution"] == "polyrl-dummy-backend" and by_name["dummy"]["version"] == "0.0.1"
    # Asked about one healthy backend only, doctor says it is healthy.
    rc, out, _ = cli("doctor", "--backend", "cpu", "--json")
    assert rc == 0 and json.loads(out)["healthy"] is True
    rc, out, _ = cli("doctor")
    assert rc == 1 and "[plugin faulty_import] (polyrl-faulty-plugins) FAILED to load" in out


def test_run_works_beside_faulty_plugins_and_names_its_backend_first(with_plugins, cli, tmp_path):
    out_dir = tmp_path / "run"
    rc, _, err = cli("run", "gpt_oss_dapo_tiny", "--output", str(out_dir), "--no-progress",
                     "trainer.total_steps=1", "data.batch_size=4")
    assert rc == 0, err
    assert err.splitlines()[0] == f"polyrl run: backend cpu (polyrl {metadata.version('polyrl')})"
    assert (out_dir / "metrics.jsonl").read_text().count("\n") == 1


# --- selection -----------------------------------------------------------------------------------------


def _dummy_class():
    return type(plugins.list_backends()["dummy"])


def test_a_cpu_plugin_is_selectable_by_name_but_never_the_implicit_default(with_plugins, monkeypatch):
    monkeypatch.setenv("POLYRL_DUMMY_AVAILABLE", "1")
    assert selection.resolve_backend().name == "cpu"  # two available non-accelerators: still cpu, no error
    assert selection.resolve_backend("dummy").name == "dummy"
    monkeypatch.setenv("POLYRL_BACKEND", "dummy")
    assert selection.resolve_backend().name == "dummy"


def test_unavailable_backend_by_name_is_refused_with_reason(with_plugins):
    with pytest.raises(BackendSelectionError, match="not available: POLYRL_DUMMY_AVAILABLE"):
        selection.resolve_backend("dummy")


def test_allow_list_excludes_plugin(with_plugins, monkeypatch):
    monkeypatch.setenv("POLYRL_DUMMY_AVAILABLE", "1")
    monkeypatch.setenv("POLYRL_LOAD_PLUGINS", "dummy2")
    plugins.reset_registry()
    assert "dummy" not in plugins.list_backends()
    assert "dummy2" in plugins.list_backends()
    with pytest.raises(BackendSelectionError, match="not in POLYRL_LOAD_PLUGINS"):
        selection.resolve_backend("dummy")


def test_two_available_accelerators_without_choice_is_an_error_naming_both(with_plugins, monkeypatch):
    monkeypatch.setenv("POLYRL_DUMMY_AVAILABLE", "1")
    monkeypatch.setattr(_dummy_class(), "is_accelerator", True)  # dummy2 inherits it
    with pytest.raises(BackendSelectionError) as err:
        selection.resolve_backend()
    assert "dummy" in str(err.value) and "dummy2" in str(err.value)
    assert selection.resolve_backend("dummy2").name == "dummy2"  # an explicit choice resolves it


def test_single_available_accelerator_wins_over_cpu(with_plugins, monkeypatch):
    monkeypatch.setenv("POLYRL_DUMMY_AVAILABLE", "1")
    monkeypatch.setenv("POLYRL_LOAD_PLUGINS", "dummy")
    plugins.reset_registry()
    monkeypatch.setattr(_dummy_class(), "is_accelerator", True)
    assert selection.resolve_backend().name == "dummy"


def test_default_is_cpu_without_accelerators():
    plugins.reset_registry()
    assert selection.resolve_backend().name == "cpu"


def test_cli_unknown_backend_in_selection_is_one_line(with_plugins, cli):
    rc, _, err = cli("doctor", "--backend", "nope")
    assert rc == 2
    assert err.strip().count("\n") == 0 and "Traceback" not in err
    assert "dummy" in err and "cpu" in err


# --- every hook, run ----------------------------------------------------------------------------------------


class InProcess:
    """A plugin object with all three hooks, counting what polyrl calls: a CPU backend whose attention wraps the
    reference, the copy task under another name, the hf engine under another name."""

    def __init__(self):
        from polyrl.backends.cpu import CpuBackend

        self.calls = {"attention": 0, "task": 0, "sample": 0, "engine": 0, "generate": 0}
        calls = self.calls

        class Counting(CpuBackend):
            name = "inproc"
            is_reference = False

            def varlen_attention(self, q, k, v, cu_seqlens, *, scale, window, sinks):
                calls["attention"] += 1
                return super().varlen_attention(q, k, v, cu_seqlens, scale=scale, window=window, sinks=sinks)

        self.backend_cls = Counting

    @plugins.hookimpl
    def polyrl_register_backends(self, register):
        register(self.backend_cls)

    @plugins.hookimpl
    def polyrl_register_tasks(self, register):
        def plugin_copy(**params):
            from polyrl.core.tasks import get_task

            self.calls["task"] += 1
            task = get_task("copy", **params)
            sample = task.sample

            def counted(n, rng):
                self.calls["sample"] += 1
                return sample(n, rng)

            task.sample = counted
            return task

        register("plugin_copy", plugin_copy)

    @plugins.hookimpl
    def polyrl_register_rollout_engines(self, register):
        def plugin_hf(model, *, pad_token_id, **kwargs):
            from polyrl.core.rollout.hf import HFEngine

            self.calls["engine"] += 1
            engine = HFEngine(model, pad_token_id=pad_token_id, **kwargs)
            generate = engine.generate

            def counted(*args, **kw):
                self.calls["generate"] += 1
                return generate(*args, **kw)

            engine.generate = counted
            return engine

        register("plugin_hf", plugin_hf)


@pytest.fixture
def in_process():
    plugin = InProcess()
    plugins.register_plugin(plugin, "in_process_test")
    yield plugin
    plugins.unregister_plugin("in_process_test")


def test_register_backends_hook_lists_the_backend(in_process, cli):
    rc, out, _ = cli("backends", "--json")
    by_name = {b["name"]: b for b in json.loads(out)["backends"]}
    assert rc == 0 and by_name["inproc"]["available"] is True
    assert by_name["inproc"]["distribution"] == "" and by_name["inproc"]["native_kernels"] == ["varlen_attention"]
    assert plugins.resolve_backend("inproc").origin() == "inproc (registered in-process)"


def test_register_tasks_hook_builds_the_task(in_process, cli):
    from polyrl.core.tasks import get_task

    assert get_task("plugin_copy", k=3, n_digits=5).name == "copy"
    rc, out, err = cli("run", "gpt_oss_dapo_tiny", "--dry-run", "data.task=plugin_copy")
    assert rc == 0, err
    assert in_process.calls["task"] == 2 and "task: plugin_copy" in out


def test_register_rollout_engines_hook_feeds_build_engine(in_process):
    from polyrl.core.models import build_model
    from polyrl.core.rollout import SamplingParams, build_engine, engine_names

    assert {"hf", "plugin_hf"} <= set(engine_names())
    model = build_model("gpt_oss_tiny", vocab_size=17, seed=0).eval()
    engine = build_engine("plugin_hf", model, pad_token_id=0)
    out = engine.generate([[1, 5, 6]], SamplingParams(max_tokens=2), row_seeds=[0])
    assert in_process.calls == {**in_process.calls, "engine": 1, "generate": 1} and len(out.response_ids) == 1
    with pytest.raises(BadInputError, match=r"unknown rollout engine 'nope' \(known: .*hf.*plugin_hf"):
        build_engine("nope", model, pad_token_id=0)


def test_a_run_uses_the_plugins_backend_task_and_engine(in_process, cli, tmp_path):
    rc, _, err = cli("run", "gpt_oss_dapo_tiny", "--backend", "inproc", "--output", str(tmp_path / "run"),
                     "--no-progress", "trainer.total_steps=1", "data.batch_size=4", "data.task=plugin_copy",
                     "rollout.engine=plugin_hf")
    assert rc == 0, err
    assert err.splitlines()[0] == "polyrl run: backend inproc (registered in-process)"
    calls = in_process.calls
    assert calls["task"] >= 1 and calls["sample"] >= 1 and calls["engine"] == 1 and calls["generate"] >= 1
    assert calls["attention"] > 0  # the model's attention ran through the plugin's backend


# --- `polyrl run --dry-run` of a full recipe before its data is downloaded --------------------------------------


def test_dry_run_of_a_full_recipe_without_its_data_file(cli, tmp_path, monkeypatch):
    import yaml

    monkeypatch.chdir(tmp_path)  # data/dapo-math-17k.parquet does not exist here
    # planned for the 8 GPUs it is sized for, on this machine without them (the backend's hardware is not needed)
    rc, out, err = cli("run", "recipes/gpt_oss_dapo.yaml", "--dry-run", "--backend", "cuda", "--nproc", "8",
                       "optimizer.lr=2e-6")
    assert rc == 0, err
    resolved = yaml.safe_load(out)
    assert resolved["data"]["path"] == "data/dapo-math-17k.parquet" and resolved["optimizer"]["lr"] == 2e-6
    assert resolved["backend"]["name"] == "cuda"
    assert "# memory plan: cuda" in out and ": fits" in out
    assert err.strip() == "polyrl run: data.path data/dapo-math-17k.parquet: not checked: file absent"
    assert not any(tmp_path.iterdir())  # nothing written
    # The rest is still validated: a bad key exits 2 with one line.
    rc, _, err = cli("run", "recipes/gpt_oss_dapo.yaml", "--dry-run", "optimizer.learning_rate=1")
    assert rc == 2 and len(err.strip().splitlines()) == 1
