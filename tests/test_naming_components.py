"""normalize_name strips wrapper components, never parts of a user's own module names."""

from __future__ import annotations

from dynascope.core.naming import normalize_name


def test_wrappers_are_whole_components() -> None:
    assert normalize_name("_orig_mod.module.0.weight") == "0.weight"
    assert normalize_name("model._fsdp_wrapped_module.layers.0._checkpoint_wrapped_module.mlp.weight") == \
        "model.layers.0.mlp.weight"
    assert normalize_name("encoder.submodule.weight") == "encoder.submodule.weight"
    assert normalize_name("my_orig_mod.x") == "my_orig_mod.x"
    assert normalize_name("module._orig_mod.0.weight") == "0.weight"
    assert normalize_name("encoder.module.weight") == "encoder.module.weight"  # a user's submodule named module
