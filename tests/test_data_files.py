"""Where strata's data files live: ``manifests/`` holds only architecture contracts (every ``*.toml``
there is one); the card presets and the real-model table sit beside their readers."""

from __future__ import annotations

from pathlib import Path

from strata import testing
from strata.budget import cards
from strata.manifests import contract
from strata.packer import fetch


def test_every_toml_in_manifests_is_an_architecture_contract():
    archs = contract.known_archs()
    assert set(testing.ARCHS) <= set(archs)
    assert not {"cards", "real_models"} & set(archs)
    for arch in archs:
        assert contract.load_manifest(arch).arch == arch


def test_card_presets_and_real_models_sit_beside_their_readers():
    assert cards.CARDS_FILE == Path(cards.__file__).resolve().parent / "cards.toml"
    defaults, presets = cards.load_cards()
    assert defaults.cuda_runtime_mib > 0 and presets
    assert (Path(fetch.__file__).resolve().parent / fetch.MANIFEST_NAME).is_file()
    assert fetch.load_specs()  # the shipped table, read through importlib.resources
