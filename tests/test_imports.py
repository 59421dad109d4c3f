"""The lower floors are cheap to import: the command line's modules, the job config and the run format load without
torch, transformers or ray (those load when a command runs), so `hsx --help` answers at once."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "ray", "pyarrow")
"""pyarrow too: the parser builds from the commands' config modules (jobs/*_config.py), never from their work."""

CHEAP_MODULES = ("cli.main", "jobs.config", "connectors.run", "connectors.lease")


def _heavy_modules_after(code: str) -> list[str]:
    """The heavy packages in sys.modules after running `code` in a fresh interpreter (nothing loaded before it)."""
    probe = (f"{code}\nimport json, sys\n"
             f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r})))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_cli_job_config_and_run_format_import_without_torch_transformers_ray_or_pyarrow():
    code = "\n".join(f"import {m}" for m in CHEAP_MODULES) + "\ncli.main.build_parser()"
    assert _heavy_modules_after(code) == []


@pytest.mark.parametrize("module", ["connectors.lease", "connectors.run", "connectors.format", "connectors.config",
                                    "connectors.base", "connectors"])
def test_each_run_format_module_alone_imports_no_torch(module):
    assert _heavy_modules_after(f"import {module}") == []


def test_the_probe_sees_pyarrow_where_a_command_works():
    assert _heavy_modules_after("import jobs.verify") == ["pyarrow"]


def test_the_probe_sees_a_heavy_import():
    """The check above can fail: a module that imports torch is reported."""
    assert _heavy_modules_after("import connectors.header") == ["torch"]


def test_the_package_names_still_load_on_first_use():
    code = ("import sys, connectors\n"
            "assert 'torch' not in sys.modules\n"
            "from connectors import HiddenStatesSpec, KVTransferConfig, load_hidden_states\n"
            "assert connectors.load_hidden_states is load_hidden_states\n"
            "assert 'torch' in sys.modules")
    assert _heavy_modules_after(code) == ["torch"]
