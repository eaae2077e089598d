"""The models' constructors refuse sizes that cannot be meant (betty.models.base.check_sizes)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("arch,kwargs,message", [
    ("sage", {"hidden": 0}, "hidden must be an integer >= 1, got 0"),
    ("gcn", {"hidden": 2.5}, "hidden must be an integer >= 1, got 2.5"),
    ("gat", {"output_heads": 1.9}, "output_heads must be an integer >= 1, got 1.9"),
    ("gat", {"heads": 0}, "heads must be an integer >= 1, got 0"),
    ("sage", {"layers": 0}, "num_layers must be an integer >= 1, got 0"),
    ("revgnn", {"hidden": 8.5}, "hidden must be an integer >= 1, got 8.5"),
    ("revgnn", {"heads": 1.9, "conv": "gat"}, "heads must be an integer >= 1, got 1.9"),
    ("revgnn", {"layers": 0}, "num_layers must be an integer >= 1, got 0"),
])
def test_model_sizes_are_integers_of_at_least_one(arch, kwargs, message):
    """A zero width built a model that ignores its input; a fractional head count was
    truncated."""
    from betty.models import build_model

    with pytest.raises(ValueError, match=message):
        build_model(arch, 8, 3, **{"hidden": 4, "layers": 1, **kwargs})
