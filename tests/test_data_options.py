"""betty.data.options: a dataset's options checked without loading anything."""

from __future__ import annotations

import subprocess
import sys

import pytest

from betty.data.options import MAX_SEED, OptionProblem, generated_config, option_problems
from betty.machine import machine_memory


def test_valid_options_have_no_problem_and_import_no_numpy_or_torch():
    assert option_problems("synthetic", {"num_nodes": 500, "seed": 3}) == []
    code = ("import sys; from betty.data.options import option_problems; "
            "option_problems('synthetic-products', {'scale': 0.5}); "
            "print(sorted({'numpy', 'torch'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("options, key, words", [
    ({"num_nodez": 5}, "num_nodez", "unknown option for dataset 'synthetic'"),
    ({"avg_degree": float("inf")}, "avg_degree", "finite"),
    ({"seed": MAX_SEED + 1}, "seed", f"from 0 to {MAX_SEED}"),
    ({"num_nodes": -4, "seed": 1}, "num_nodes", "num_nodes=-4 (allowed: integer >= 2)"),
])
def test_each_problem_names_its_option(options, key, words):
    problems = option_problems("synthetic", options)
    assert [p.key for p in problems] == [key]
    assert words in problems[0].message
    assert problems[0].unknown == (key == "num_nodez")


def test_a_generated_graph_larger_than_memory_is_refused_before_generating():
    (problem,) = option_problems("synthetic", {"num_nodes": 10**12})
    assert problem.key is None and "more than this machine's memory" in problem.message
    assert generated_config("synthetic", {"num_nodes": 10**12}).scaled_num_nodes == 10**12
    assert generated_config("cora", {}) is None
    assert machine_memory() > 0
    assert isinstance(problem, OptionProblem)


@pytest.mark.parametrize("name, options, key, words", [
    ("synthetic-papers", {"self_loops": True}, "self_loops", "(allowed: false)"),
    ("synthetic", {"max_degree": 5}, "max_degree", "allowed: None or a number > avg_degree = 20.0"),
    ("synthetic-papers", {"scale": 100.0}, "scale", "fewer than 2^31 nodes, int32 indices: at most 19.33)"),
])
def test_what_loading_would_refuse_is_a_problem_before_loading(name, options, key, words, tmp_path):
    """Options the loader or generator refuses are found by the check a spec runs, so
    ``betty validate`` does not pass a spec the download stage then fails."""
    from betty.data import load_dataset

    (problem,) = option_problems(name, options)
    assert problem.key == key and words in problem.message
    with pytest.raises(ValueError, match="allowed"):
        load_dataset(name, str(tmp_path), **options)
    assert not any(tmp_path.iterdir())  # refused before anything was written
