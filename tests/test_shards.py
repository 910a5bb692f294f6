"""Shards of a checkpoint's arrays (io/shards.py) and the parts processes write (manifests.py):
any block read back from shards of any other split, and what does not tile named."""

import json

import numpy as np
import pytest

from megatrain_jax.io import array_files, manifests, shards
from megatrain_jax.io.array_files import Damaged

WHOLE = np.arange(4 * 6 * 2, dtype=np.float32).reshape(4, 6, 2)


def _split(array: np.ndarray, dim: int, parts: int) -> list[tuple]:
    """The regions of `array` split into `parts` along `dim`."""
    step = array.shape[dim] // parts
    return [tuple((k * step, (k + 1) * step) if d == dim else (0, n)
                  for d, n in enumerate(array.shape)) for k in range(parts)]


def _write(folder, array: np.ndarray, regions: list[tuple]) -> list[dict]:
    """Each region of `array` in a file of its own, as a save writes a process's shards."""
    written = []
    for k, region in enumerate(regions):
        block = np.ascontiguousarray(array[tuple(slice(a, b) for a, b in region)])
        file = f"a@{k}.bin"
        checksum = array_files.write_array(folder / file, array_files.byte_view(block),
                                           array.dtype)
        written.append({"region": [list(r) for r in region], "file": file,
                        "bytes": block.nbytes, "checksum": checksum})
    return written


@pytest.mark.parametrize("stored_dim", [0, 1, 2])
def test_any_block_reads_back_from_shards_split_along_any_dimension(tmp_path, stored_dim):
    stored = _write(tmp_path, WHOLE, _split(WHOLE, stored_dim, 2))
    for dim, parts in ((0, 4), (1, 3), (2, 2), (0, 1)):
        for region in _split(WHOLE, dim, parts):
            block = shards.read_region(tmp_path, stored, region, np.float32)
            np.testing.assert_array_equal(block, WHOLE[tuple(slice(a, b) for a, b in region)])
    middle = ((1, 3), (2, 5), (0, 2))  # a block that is no tile of any split
    np.testing.assert_array_equal(shards.read_region(tmp_path, stored, middle, np.float32),
                                  WHOLE[1:3, 2:5])


def test_a_scalar_is_one_shard(tmp_path):
    scalar = np.array(7, np.int32)
    stored = _write(tmp_path, scalar, [()])
    assert shards.read_region(tmp_path, stored, (), np.int32) == 7


def test_a_damaged_shard_is_named_even_when_only_part_of_it_is_needed(tmp_path):
    stored = _write(tmp_path, WHOLE, _split(WHOLE, 1, 2))
    raw = bytearray((tmp_path / "a@1.bin").read_bytes())
    raw[5] ^= 1
    (tmp_path / "a@1.bin").write_bytes(bytes(raw))
    assert shards.read_region(tmp_path, stored, _split(WHOLE, 1, 2)[0], np.float32).shape
    with pytest.raises(Damaged, match=r"a@1.bin does not match the checksum"):
        shards.read_region(tmp_path, stored, ((0, 1), (0, 6), (0, 2)), np.float32)


def test_regions_that_do_not_tile_the_array_are_named():
    tiles = _split(WHOLE, 0, 2)
    assert shards.coverage_problem(WHOLE.shape, tiles) is None
    assert shards.coverage_problem(WHOLE.shape, tiles[:1]) == "its shards hold 24 of its 48 " \
                                                             "elements"
    assert shards.coverage_problem(WHOLE.shape, [tiles[0], tiles[0]]) == \
        "two shards hold the same block"
    assert "outside the shape" in shards.coverage_problem(WHOLE.shape, [((0, 5), (0, 6),
                                                                         (0, 2))])


def _parts(folder, array_parts: list[list[dict]]) -> None:
    for process, held in enumerate(array_parts):
        (folder / manifests.part_file(process)).write_text(json.dumps(
            [{"key": "['a']", "shape": list(WHOLE.shape), "dtype": "float32",
              "shards": held}]))


def test_the_parts_of_every_process_merge_into_one_array_or_are_refused(tmp_path):
    stored = _write(tmp_path, WHOLE, _split(WHOLE, 0, 2))
    _parts(tmp_path, [[stored[0]], [stored[1]]])
    (merged,) = manifests.merge_parts(tmp_path, 2)
    assert merged["shards"] == stored
    _parts(tmp_path, [[stored[0]], []])  # process 1 lists nothing of it
    with pytest.raises(manifests.PartsDisagree, match=r"\['a'\]: its shards hold 24 of its 48"):
        manifests.merge_parts(tmp_path, 2)
    with pytest.raises(manifests.PartsDisagree, match="part-2.json cannot be read .* every "
                                                      "process sees"):
        manifests.merge_parts(tmp_path, 3)
    _parts(tmp_path, [[stored[0]], [stored[1]]])
    (tmp_path / "a@1.bin").write_bytes(b"short")
    with pytest.raises(manifests.PartsDisagree, match=r"a@1.bin holds 5 bytes, 96 written"):
        manifests.merge_parts(tmp_path, 2)


def test_a_checkpoint_of_format_1_reads_as_one_shard_per_array(tmp_path):
    """Format 1, before shards: one whole file per array, named at the array's entry."""
    import jax

    from megatrain_jax.io.checkpoint import Checkpointer

    folder = tmp_path / "5"
    folder.mkdir()
    (stored,) = _write(folder, WHOLE, [shards.whole(WHOLE.shape)])
    entry = {"key": "['a']", "file": stored["file"], "shape": list(WHOLE.shape),
             "dtype": "float32", "bytes": stored["bytes"], "checksum": stored["checksum"]}
    (folder / "manifest.json").write_text(json.dumps(
        {"format": "megatrain-checkpoint/1", "step": 5, "meta": {"step": 5}, "arrays": [entry]}))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tree, meta = Checkpointer(tmp_path).restore(
        5, {"a": jax.ShapeDtypeStruct(WHOLE.shape, np.float32, sharding=device)})
    assert meta == {"step": 5} and isinstance(tree["a"], jax.Array)
    np.testing.assert_array_equal(np.asarray(tree["a"]), WHOLE)
