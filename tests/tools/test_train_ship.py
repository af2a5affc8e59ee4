"""Shipping trained weights (tools/train/ship.py): a tree assembled from parts loads through the services'
loaders and verifies against its manifest; a changed, lost or added file is named; parts that do not fit the tiny
preset are refused without leaving a tree behind."""

import json

import pytest

from services.checkpoints import write_tree
from services.dit.model.checkpoint import write_random_checkpoint
from services.dit.model.network import PRESETS
from tools.train import ship

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    return write_tree("tiny", tmp_path_factory.mktemp("parts") / "tree")


def _assemble(parts, out, base=None):
    root = parts / "MiniMax-H3"
    return ship.assemble(out, root, root, base or root / "FL2VA" / "transformer", parts / "TaoMate-H3",
                         ["test tree"])


def test_an_assembled_tree_loads_and_verifies_with_every_file_in_its_manifest(parts, tmp_path):
    tree = _assemble(parts, tmp_path / "models" / "tiny")
    assert ship.verify(tree) == []
    manifest = json.loads((tree / "MANIFEST.json").read_text())
    assert manifest["notes"] == ["test tree"] and (tree / "COMPLETE").is_file()
    names = set(manifest["files"])
    assert "MiniMax-H3/FL2VA/transformer/model.safetensors.index.json" in names
    assert "TaoMate-H3/adapter_model.safetensors" in names and "MiniMax-H3/tokenizer/tokenizer.json" in names
    ship.check_loads(tree)
    assert ship.main(["--verify", str(tree)]) == 0


def test_verify_names_a_changed_a_lost_and_an_extra_file(parts, tmp_path):
    tree = _assemble(parts, tmp_path / "t")
    shard = tree / "MiniMax-H3" / "FL2VA" / "transformer" / "model-00003-of-00013.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    (tree / "TaoMate-H3" / "config.json").unlink()
    (tree / "stray.txt").write_text("x")
    problems = ship.verify(tree)
    assert len(problems) == 3
    assert any(p.startswith("MiniMax-H3/FL2VA/transformer/model-00003-of-00013.safetensors: ") for p in problems)
    assert "TaoMate-H3/config.json: missing" in problems and "stray.txt: not in the manifest" in problems
    assert ship.main(["--verify", str(tree)]) == 1


def test_a_base_of_other_dims_is_refused_and_leaves_no_tree(parts, tmp_path):
    from dataclasses import replace
    wide = write_random_checkpoint(replace(PRESETS["tiny"], hidden_size=128, ffn_hidden=256), tmp_path / "wide",
                                   layout="original")
    with pytest.raises(Exception, match="config|shape|hidden"):
        _assemble(parts, tmp_path / "out", base=wide)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_an_unfinished_tree_does_not_verify(parts, tmp_path):
    tree = _assemble(parts, tmp_path / "t")
    (tree / "COMPLETE").unlink()
    assert ship.verify(tree) == [f"{tree / 'COMPLETE'} is missing: the tree was never finished"]


def test_an_assembled_tree_is_readable_by_every_user_whatever_modes_its_parts_had(parts, tmp_path):
    shard = next((parts / "MiniMax-H3" / "FL2VA" / "transformer").glob("*.safetensors"))
    shard.chmod(0o600)  # as a part made where the umask is 077 comes
    try:
        tree = _assemble(parts, tmp_path / "models" / "tiny")
    finally:
        shard.chmod(0o644)
    modes = {p.relative_to(tree).as_posix(): p.stat().st_mode & 0o777 for p in tree.rglob("*")}
    assert {m for name, m in modes.items() if (tree / name).is_file()} == {0o644}
    assert {m for name, m in modes.items() if (tree / name).is_dir()} == {0o755}
