"""Importing betty (or workflow) sets the process defaults torch reads on import, and
never overrides a value the user set."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = ("OMP_WAIT_POLICY", "THP_MEM_ALLOC_ENABLE")


def _environment_after(module: str, preset: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in KEYS}
    env.update(preset, PYTHONPATH=ROOT)
    code = (f"import {module}, os, sys; "
            f"print(' '.join(os.environ.get(k, '-') for k in {KEYS!r})); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split("\n")
    values, torch_imported = out[0].split(), out[1] == "True"
    assert not torch_imported  # set before torch: importing betty must not import it
    return dict(zip(KEYS, values))


@pytest.mark.parametrize("module", ["betty", "workflow.env"])
def test_defaults_are_set_before_torch(module):
    assert _environment_after(module, {}) == {"OMP_WAIT_POLICY": "PASSIVE", "THP_MEM_ALLOC_ENABLE": "1"}


def test_a_value_the_user_set_is_kept():
    assert _environment_after("betty", {"THP_MEM_ALLOC_ENABLE": "0", "OMP_WAIT_POLICY": "ACTIVE"}) == \
        {"OMP_WAIT_POLICY": "ACTIVE", "THP_MEM_ALLOC_ENABLE": "0"}
