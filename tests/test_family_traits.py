"""A family's layer traits live in one table (slime.utils.model_families.FAMILIES): the Megatron
conversion and the architecture flag checks both follow it. Changing a trait in the registry
changes what both read, and no other table of model_types is left in either."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from slime.backends.megatron.convert import Layout
from slime.backends.megatron.families import SUPPORTED
from slime.config.architecture import hf_architecture
from slime.utils import model_families
from slime.utils.model_families import FAMILIES


def qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )


@pytest.mark.parametrize(
    "trait, layout_field, flag",
    [("qk_norm", "qk_norm", "qk_layernorm"), ("qkv_bias", "qkv_bias", "add_qkv_bias")],
)
def test_a_trait_changed_in_the_registry_changes_the_conversion_and_the_flag_check(
    monkeypatch, trait, layout_field, flag
):
    config = qwen3_config()
    before = (getattr(Layout.from_hf_config(config), layout_field), hf_architecture(config).values[flag])
    changed = dataclasses.replace(FAMILIES["qwen3"], **{trait: not getattr(FAMILIES["qwen3"], trait)})
    monkeypatch.setitem(FAMILIES, "qwen3", changed)
    monkeypatch.setitem(SUPPORTED, "qwen3", changed)
    after = (getattr(Layout.from_hf_config(config), layout_field), hf_architecture(config).values[flag])
    assert before == (not getattr(changed, trait),) * 2 and after == (getattr(changed, trait),) * 2


def test_the_megatron_backend_builds_exactly_the_families_the_registry_does_not_refuse():
    assert set(SUPPORTED) == {t for t, f in FAMILIES.items() if f.megatron is None}
    assert all(model_families.megatron_refusal(t) is None for t in SUPPORTED)


# The model_types still named outside the registry, each for one detail of reading its config.
NAMED = {
    "backends/megatron/families.py": {"qwen3_next"},  # its delta-net projections are split
    "config/architecture.py": {"qwen3_5_moe", "qwen3_5_moe_text"},  # top-k renormalised, no field
}


def test_no_other_table_of_model_types_is_left_in_the_conversion_or_the_flag_checks():
    root = pathlib.Path(model_families.__file__).parents[1]
    for path, expected in NAMED.items():
        text = (root / path).read_text()
        assert {t for t in FAMILIES if f'"{t}"' in text} == expected, path
