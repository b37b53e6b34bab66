"""One typed settings object: defaults, environment, clear errors, and the generated docs table."""

from __future__ import annotations

from pathlib import Path

import pytest

from aios_blocks import settings as st


def test_defaults_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIOS_NODE_TIMEOUT_S", raising=False)
    assert st.Settings().node_timeout_s == 15.0 and st.Settings().commit_retries == 5
    monkeypatch.setenv("AIOS_NODE_TIMEOUT_S", "2.5")
    monkeypatch.setenv("AIOS_STARLARK_SANDBOX", "inline")
    s = st.Settings()
    assert s.node_timeout_s == 2.5 and s.starlark_sandbox == "inline"


def test_a_bad_value_stops_with_the_variable_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOS_COMMIT_RETRIES", "0")
    monkeypatch.setenv("AIOS_STARLARK_SANDBOX", "docker")
    st.load.cache_clear()
    try:
        with pytest.raises(st.BadSettings) as err:
            st.load()
        text = str(err.value)
        assert "AIOS_COMMIT_RETRIES: Input should be greater than or equal to 1 (got '0')" in text
        assert "AIOS_STARLARK_SANDBOX" in text
    finally:
        monkeypatch.delenv("AIOS_COMMIT_RETRIES")
        monkeypatch.delenv("AIOS_STARLARK_SANDBOX")
        st.load.cache_clear()


def test_the_worker_takes_its_settings_from_the_object_passed_in() -> None:
    from aios_blocks.workers.base import Worker

    custom = st.Settings(max_replacements=1, dry_run_deadline_s=0.5)
    w = Worker(bus=None, store=None, inventory=None, runtime=None, name="t", settings=custom)  # type: ignore[arg-type]
    assert w.settings.max_replacements == 1 and w.settings.dry_run_deadline_s == 0.5


def test_docs_settings_table_equals_the_settings() -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "settings.md"
    text = doc.read_text()
    begin, end = "<!-- settings:begin -->", "<!-- settings:end -->"
    table = text[text.index(begin) + len(begin):text.index(end)].strip()
    assert table == st.markdown(), "docs/settings.md is stale: paste `blocks settings --markdown` between the markers"
    for name in st.Settings.model_fields:
        assert f"`AIOS_{name.upper()}`" in table


def test_library_modules_do_not_read_the_environment() -> None:
    src = Path(st.__file__).parent
    # the instance and side-car SDKs (and the GPU probe instance) run inside an instance or side-car, whose
    # contract with its node agent is environment variables; the process code (runtime/: entry points,
    # supervisor, embedded servers, the fault points of the chaos tests) and launchers of child processes
    # (the console's) pass the environment on to the processes they start
    allowed = {"cli", "runtime", "settings.py", "embedded.py", "supervisor.py", "main.py", "launch.py", "runtime_process.py", "auth.py", "locate.py", "faults.py", "instance", "sidecar.py",
               "gpu_probe"}
    offenders = [
        str(p.relative_to(src)) for p in src.rglob("*.py")
        if "os.environ" in p.read_text() and not ({p.name, *p.relative_to(src).parts} & allowed)
    ]
    assert offenders == []


def test_the_parser_pins_the_placement_defaults_into_the_rules() -> None:
    from aios_blocks.handlers import parse

    comp = {
        "componentURI": "aios://m", "resources": {"gpus": 1},
        "policies": [
            {"name": "clusterAllocator", "policyRuleURI": "builtin:cluster-rank"},
            {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack", "settings": {"sampleNodes": 7}},
        ],
    }
    out = parse.build({"blockComponentURI": "aios://m", "minInstances": 1, "maxInstances": 1}, comp, "b1",
                      settings=st.Settings(sample_nodes=50, max_candidates=2))
    assert out.ir is not None, out.errors
    assert out.ir["policies"]["clusterAllocator"]["parameters"]["maxCandidates"] == 2
    assert out.ir["policies"]["resourceAllocator"]["settings"]["sampleNodes"] == 7  # the spec's value is kept


def test_workers_collect_young_objects_less_often_as_the_setting_says(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    from aios_blocks.runtime.main import tune_gc

    before = gc.get_threshold()
    try:
        monkeypatch.setenv("AIOS_GC_GEN0_THRESHOLD", "12345")
        tune_gc(st.current().gc_gen0_threshold)
        assert gc.get_threshold() == (12345, before[1], before[2])
        gc.set_threshold(*before)
        tune_gc(0)  # 0: Python's own threshold stays
        assert gc.get_threshold() == before
        assert st.Settings().gc_gen0_threshold == 12345 and st.Settings.model_fields["gc_gen0_threshold"].default == 10_000
    finally:
        gc.set_threshold(*before)
