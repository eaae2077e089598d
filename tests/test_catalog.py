"""betty.catalog (the names a spec may use, importable without numpy or torch) lists
exactly what the implementing modules provide."""

import subprocess
import sys


def test_every_registry_matches_the_catalog():
    from betty import catalog
    from betty.models import ARCHS, SAGE_AGGREGATORS
    from betty.models.base import _ACTIVATION_FNS
    from betty.partition import PARTITIONERS
    from betty.rev.engine import CLUSTER_METHODS
    from betty.rev.training import PARTITION_METHODS as CLUSTER_CUTS
    from betty.train import OPTIMIZERS, build_optimizer

    assert ARCHS == catalog.ARCHS and SAGE_AGGREGATORS == catalog.SAGE_AGGREGATORS
    assert tuple(_ACTIVATION_FNS) == catalog.ACTIVATIONS
    assert sorted(PARTITIONERS) == sorted(catalog.PARTITION_METHODS)
    assert OPTIMIZERS == catalog.OPTIMIZERS
    assert CLUSTER_METHODS == CLUSTER_CUTS == catalog.CLUSTER_METHODS
    import torch

    for name in catalog.OPTIMIZERS:  # each name builds its optimizer
        build_optimizer(name, [torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def test_dataset_names_match_the_loaders():
    from betty.data import dataset_names
    from betty.data.dgl_builtin import DGL_BUILTINS
    from betty.data.names import DGL_BUILTIN_NAMES, OGB_NAMES, PLANETOID_NAMES
    from betty.data.ogb_loader import OGB_RECIPES

    assert tuple(OGB_RECIPES) == OGB_NAMES and tuple(DGL_BUILTINS) == DGL_BUILTIN_NAMES
    assert set(PLANETOID_NAMES) <= set(DGL_BUILTIN_NAMES)
    assert set(OGB_NAMES) | set(DGL_BUILTIN_NAMES) <= set(dataset_names())


def test_names_and_spec_checks_import_no_framework():
    code = ("import sys\n"
            "from betty import catalog\n"
            "from betty.data import dataset_names, resolve_options\n"
            "from workflow.specfile import load_spec\n"
            "load_spec('synthetic_products'); load_spec('cora_gat')\n"
            "resolve_options('synthetic', {'scale': 0.5})\n"
            "print(sorted(m for m in ('torch', 'numpy', 'scipy', 'dgl', 'torch_geometric') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": ":".join(sys.path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
