"""The recurrent head family is one protocol, one drafter per tree policy and one loss, shared by Clover-2, Clover-1
and EAGLE-1; the other types are not of it."""

import pytest

from clover_jax.decoding.tree import DynamicTree, TreeSpec
from clover_jax.heads import registry
from clover_jax.heads.recurrent import RecurrentHead
from clover_jax.heads.recurrent.drafter import RecurrentDrafter, RecurrentDynamicDrafter


@pytest.mark.parametrize("name", ["clover2", "clover1", "eagle"])
def test_the_family_shares_its_protocol_and_drafters(name):
    ht = registry.get(name)
    assert issubclass(ht.module_cls, RecurrentHead)
    assert issubclass(ht.drafters[TreeSpec], RecurrentDrafter)
    assert issubclass(ht.drafters[DynamicTree], RecurrentDynamicDrafter)


@pytest.mark.parametrize("name", ["medusa", "redrafter", "block"])
def test_other_head_types_are_not_of_the_family(name):
    ht = registry.get(name)
    assert not issubclass(ht.module_cls, RecurrentHead)
    assert not any(issubclass(d, (RecurrentDrafter, RecurrentDynamicDrafter)) for d in ht.drafters.values())
