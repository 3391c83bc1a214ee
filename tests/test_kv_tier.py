"""The KV tier's storage (engine/kv/tier.py): copies between a paged pool and the tier for both tier kinds and
dtypes, the disk tier's index across a simulated restart, and every way a stale, foreign or corrupt file must be
refused with a warning instead of being loaded."""

from __future__ import annotations

import logging
import os
import struct

import numpy as np
import pytest
import torch

from ironlm.engine.kv.tier import KVTier, TierGeometry, fingerprint
from ironlm.exceptions import InvalidArgumentError

NUM_BLOCKS = 12
NUM_SLOTS = 8
FP = "ab" * 16


def geometry(dtype: torch.dtype = torch.float32) -> TierGeometry:
    return TierGeometry(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)


def random_caches(g: TierGeometry, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, g.block_size, g.num_kv_heads, g.head_dim)
    return [(torch.randn(shape, generator=gen).to(g.dtype), torch.randn(shape, generator=gen).to(g.dtype))
            for _ in range(g.num_layers)]


def make_tier(kind: str, g: TierGeometry, tmp_path: os.PathLike[str], fp: str = FP) -> KVTier:
    if kind == "memory":
        return KVTier.memory(g, NUM_SLOTS, torch.device("cpu"))
    return KVTier.disk(g, NUM_SLOTS, os.fspath(tmp_path), fp)


def pairs(rows: list[tuple[int, int]]) -> np.ndarray:
    return np.array(rows, dtype=np.int64).reshape(-1, 2)


def assert_blocks_equal(a: list[tuple[torch.Tensor, torch.Tensor]], a_blocks: list[int],
                        b: list[tuple[torch.Tensor, torch.Tensor]], b_blocks: list[int]) -> None:
    for (ka, va), (kb, vb) in zip(a, b):
        assert torch.equal(ka[a_blocks], kb[b_blocks])
        assert torch.equal(va[a_blocks], vb[b_blocks])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("kind", ["memory", "disk"])
@pytest.mark.parametrize("path", ["index", "runs"])
def test_store_load_roundtrip(kind, dtype, path, tmp_path):
    """Blocks demoted to scattered slots come back bit-exact into other device blocks; untouched blocks stay.
    `runs` drives the GPU code path (slot-sorted gather, one copy per run of consecutive slots) on CPU tensors."""
    g = geometry(dtype)
    tier = make_tier(kind, g, tmp_path)
    try:
        src = random_caches(g, seed=1)
        # slots out of order, with a run (5, 6, 7) and a gap, to exercise the run splitting
        demote = pairs([(3, 6), (0, 2), (7, 5), (9, 7), (1, 0)])
        promote = pairs([(6, 10), (2, 4), (5, 0), (7, 11), (0, 1)])
        dst = random_caches(g, seed=2)
        before = [(k.clone(), v.clone()) for k, v in dst]
        if path == "index":
            tier.store(src, demote)
            tier.load(dst, promote)
        else:
            tier._store_runs(src, demote[:, 0].copy(), demote[:, 1].copy())
            tier._load_runs(dst, promote[:, 1].copy(), promote[:, 0].copy())
        assert_blocks_equal(src, [3, 0, 7, 9, 1], dst, [10, 4, 0, 11, 1])
        untouched = [2, 3, 5, 6, 7, 8, 9]
        assert_blocks_equal(before, untouched, dst, untouched)
        # the tier tensor is slot-major: slot 6 holds block 3 of every layer, keys then values
        assert torch.equal(tier._data[6, 1, 1], src[1][1][3])
    finally:
        tier.close()


def test_empty_pairs_are_noops(tmp_path):
    g = geometry()
    tier = make_tier("memory", g, tmp_path)
    caches = random_caches(g, seed=3)
    before = [(k.clone(), v.clone()) for k, v in caches]
    tier.store(caches, np.zeros((0, 2), dtype=np.int64))
    tier.load(caches, np.zeros((0, 2), dtype=np.int64))
    assert_blocks_equal(before, list(range(NUM_BLOCKS)), caches, list(range(NUM_BLOCKS)))


@pytest.mark.parametrize("bad", [[(0, NUM_SLOTS)], [(0, -1)], [(NUM_BLOCKS, 0)], [(-1, 0)]])
def test_out_of_range_index_is_refused_before_any_copy(bad, tmp_path):
    g = geometry()
    tier = make_tier("disk", g, tmp_path)
    try:
        caches = random_caches(g, seed=4)
        tier.store(caches, pairs([(2, 3)]))
        snapshot = tier._data.clone()
        with pytest.raises(InvalidArgumentError) as err:
            tier.store(caches, pairs([(1, 1), *bad]))
        assert err.value.param == "pairs"
        assert torch.equal(tier._data, snapshot)  # not even the valid first row was copied
        with pytest.raises(InvalidArgumentError):
            tier.load(caches, pairs([(b, a) for a, b in bad]))
    finally:
        tier.close()


def test_mismatched_caches_are_refused(tmp_path):
    tier = make_tier("memory", geometry(torch.float32), tmp_path)
    with pytest.raises(InvalidArgumentError) as err:
        tier.store(random_caches(geometry(torch.bfloat16), seed=5), pairs([(0, 0)]))
    assert err.value.param == "kv_caches"


def entries_for(g: TierGeometry) -> list[tuple[int, int, str | None, list[int]]]:
    # a chain 2 -> 5 -> 0 and a second root 7 with child 1; parents before children, as tier_entries() gives them
    bs = g.block_size
    return [(2, -1, None, list(range(bs))), (5, 2, None, list(range(bs, 2 * bs))),
            (0, 5, None, list(range(2 * bs, 3 * bs))), (7, -1, "tenant-a", [9] * bs), (1, 7, "tenant-a", [8] * bs)]


def saved_tier(tmp_path: os.PathLike[str], dtype: torch.dtype = torch.float32):
    g = geometry(dtype)
    tier = make_tier("disk", g, tmp_path)
    caches = random_caches(g, seed=6)
    tier.store(caches, pairs([(4, 2), (6, 5), (8, 0), (10, 7), (11, 1)]))
    entries = entries_for(g)
    tier.save_index(entries)
    tier.close()
    return g, caches, entries


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_survives_restart_and_is_deleted_after_load(dtype, tmp_path, caplog):
    g, caches, entries = saved_tier(tmp_path, dtype)
    index = tmp_path / f"{FP}.idx"
    assert index.exists() and (tmp_path / f"{FP}.kv").stat().st_size == NUM_SLOTS * g.bytes_per_block
    tier = make_tier("disk", g, tmp_path)  # a new process, in effect: a fresh mapping of the same file
    try:
        with caplog.at_level(logging.WARNING):
            assert tier.load_index() == entries
        assert not caplog.records
        assert not index.exists()  # the data changes from now on: a crash must not find an index vouching for it
        assert tier.load_index() == []
        restored = random_caches(g, seed=7)
        tier.load(restored, pairs([(2, 0), (5, 1), (0, 2), (7, 3), (1, 4)]))
        assert_blocks_equal(caches, [4, 6, 8, 10, 11], restored, [0, 1, 2, 3, 4])
    finally:
        tier.close()


def flip_slot_byte(tmp_path: os.PathLike[str], g: TierGeometry, slot: int) -> None:
    with open(os.path.join(tmp_path, f"{FP}.kv"), "r+b") as f:
        f.seek(slot * g.bytes_per_block + g.bytes_per_block // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))


def test_corrupt_slot_drops_that_entry_and_its_descendants(tmp_path, caplog):
    g, _, entries = saved_tier(tmp_path)
    flip_slot_byte(tmp_path, g, 7)  # the root of the second chain
    tier = make_tier("disk", g, tmp_path)
    try:
        with caplog.at_level(logging.WARNING):
            kept = tier.load_index()
        assert kept == entries[:3]  # 7 fails its checksum; 1 is its child
        assert "slot 7" in caplog.text and "1 corrupt, 1 orphaned" in caplog.text
    finally:
        tier.close()


def test_corrupt_leaf_drops_exactly_that_entry(tmp_path, caplog):
    g, _, entries = saved_tier(tmp_path)
    flip_slot_byte(tmp_path, g, 0)
    tier = make_tier("disk", g, tmp_path)
    try:
        with caplog.at_level(logging.WARNING):
            assert tier.load_index() == [e for e in entries if e[0] != 0]
        assert "1 corrupt, 0 orphaned" in caplog.text
    finally:
        tier.close()


def rewrite_index(tmp_path: os.PathLike[str], edit) -> None:
    path = os.path.join(tmp_path, f"{FP}.idx")
    with open(path, "rb") as f:
        blob = f.read()
    with open(path, "wb") as f:
        f.write(edit(blob))


def replace_in_body(old: bytes, new: bytes):
    """Edit the JSON body and re-sign it, so that only the check under test can refuse the file."""
    import hashlib

    def edit(blob: bytes) -> bytes:
        header = struct.Struct("<8sIQ16s")
        magic, version, _, _ = header.unpack_from(blob)
        body = blob[header.size:]
        assert old in body
        body = body.replace(old, new)
        return header.pack(magic, version, len(body), hashlib.blake2b(body, digest_size=16).digest()) + body
    return edit


@pytest.mark.parametrize("edit, why", [
    (lambda b: b[:len(b) // 2], "truncated"),
    (lambda b: b[:10], "truncated header"),
    (lambda b: b"GARBAGE!" + b[8:], "bad magic"),
    (lambda b: b[:8] + struct.pack("<I", 99) + b[12:], "format version 99"),
    (lambda b: b[:-5] + b"12345", "body checksum"),
    (lambda b: os.urandom(len(b)), "bad magic"),
    (replace_in_body(f'"fingerprint":"{FP}"'.encode(), b'"fingerprint":"cd"'), "foreign fingerprint"),
    (replace_in_body(b'"head_dim":8', b'"head_dim":16'), "geometry"),
    (replace_in_body(b'"entries":[', b'"entries":{"x":['), "unparsable"),
])
def test_bad_index_is_ignored_with_a_warning(edit, why, tmp_path, caplog):
    g, _, _ = saved_tier(tmp_path)
    rewrite_index(tmp_path, edit)
    tier = make_tier("disk", g, tmp_path)
    try:
        with caplog.at_level(logging.WARNING):
            assert tier.load_index() == []
        assert why in caplog.text and f"{FP}.idx" in caplog.text
        assert not (tmp_path / f"{FP}.idx").exists()
    finally:
        tier.close()


def test_malformed_entries_are_dropped(tmp_path, caplog):
    g, _, entries = saved_tier(tmp_path)
    # the second root's token list loses one token: wrong length for the block size
    rewrite_index(tmp_path, replace_in_body(b"[9,9,9,9]", b"[9,9,9]"))
    tier = make_tier("disk", g, tmp_path)
    try:
        with caplog.at_level(logging.WARNING):
            assert tier.load_index() == entries[:3]
        assert "1 malformed" in caplog.text
    finally:
        tier.close()


def test_foreign_fingerprint_file_is_not_read(tmp_path):
    g, _, _ = saved_tier(tmp_path)
    other = make_tier("disk", g, tmp_path, fp="cd" * 16)
    try:
        assert other.load_index() == []
        assert (tmp_path / f"{FP}.idx").exists()  # another model's cache is left alone
    finally:
        other.close()


def test_disk_tier_errors(tmp_path):
    g = geometry()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(InvalidArgumentError) as err:
        KVTier.disk(g, NUM_SLOTS, os.fspath(blocker / "kv"), FP)  # a file where a folder should be
    assert err.value.param == "kv_offload_dir"
    tier = make_tier("disk", g, tmp_path)
    try:
        with pytest.raises(InvalidArgumentError) as err:
            make_tier("disk", g, tmp_path)  # the same file twice: the second would overwrite the first's slots
        assert err.value.param == "kv_offload_dir" and "in use" in str(err.value)
    finally:
        tier.close()
    make_tier("disk", g, tmp_path).close()  # close released the lock
    with pytest.raises(InvalidArgumentError) as err:
        KVTier.memory(g, 0, torch.device("cpu"))
    assert err.value.param == "num_slots"


def test_memory_tier_has_nothing_to_persist(tmp_path):
    g = geometry()
    tier = make_tier("memory", g, tmp_path)
    assert not tier.persistent and tier.kind == "memory"
    tier.save_index(entries_for(g))
    assert tier.load_index() == [] and list(tmp_path.iterdir()) == []


def test_fingerprint_changes_with_every_input(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    big = bytearray(os.urandom(2 << 20))
    (model / "model.safetensors").write_bytes(big)
    (model / ".cache").mkdir()
    (model / ".cache" / "meta").write_text("download metadata")

    class Tok:
        def __init__(self, vocab: dict[str, int]) -> None:
            self.vocab = vocab

        def get_vocab(self) -> dict[str, int]:
            return self.vocab

    tok = Tok({"a": 0, "b": 1})
    g = geometry()

    def fp(**kw) -> str:
        args = {"model_path": model, "tokenizer": tok, "geometry": g, "quantization": "none"} | kw
        return fingerprint(**args)

    base = fp()
    assert len(base) == 32 and int(base, 16) >= 0 and fp() == base
    (model / ".cache" / "meta").write_text("changed")
    os.utime(model / "model.safetensors", (0, 0))
    assert fp() == base  # hidden entries and modification times are not part of the identity
    variants = [
        fp(tokenizer=Tok({"a": 0, "c": 1})), fp(tokenizer=None), fp(geometry=geometry(torch.bfloat16)),
        fp(geometry=TierGeometry(3, 8, 2, 8, torch.float32)), fp(quantization="int8"),
        fp(quantization="int8", quantization_group_size=64), fp(tp_rank=1, tp_size=2), fp(salt="tenant"),
    ]
    big[0] ^= 1  # the safetensors header
    (model / "model.safetensors").write_bytes(big)
    variants.append(fp())
    # One byte inside a tensor, between what 8 evenly spaced 64 KiB samples read (a fine-tune's changed layer):
    # the sampled fingerprint missed it and served the old model's KV.
    big[100 << 10] ^= 1
    (model / "model.safetensors").write_bytes(big)
    variants.append(fp())
    big.append(0)
    (model / "model.safetensors").write_bytes(big)
    variants.append(fp())
    (model / "config.json").write_text('{"hidden_size": 65}')
    variants.append(fp())
    assert len({base, *variants}) == len(variants) + 1
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    assert fingerprint(gguf, tok, g, quantization="auto") != fingerprint(model, tok, g, quantization="auto")
    with pytest.raises(InvalidArgumentError):
        fingerprint(tmp_path / "missing", tok, g, quantization="auto")


def test_resized_tier_keeps_the_slots_that_still_exist(tmp_path, caplog):
    g, caches, entries = saved_tier(tmp_path)
    tier = KVTier.disk(g, 6, os.fspath(tmp_path), FP)  # restarted with a smaller kv_offload_size
    try:
        assert (tmp_path / f"{FP}.kv").stat().st_size == 6 * g.bytes_per_block
        with caplog.at_level(logging.WARNING):
            assert tier.load_index() == entries[:3]  # slot 7 is gone, and with it its child 1
        assert "1 orphaned, 1 past the resized tier's end" in caplog.text
        restored = random_caches(g, seed=8)
        tier.load(restored, pairs([(2, 0), (5, 1), (0, 2)]))
        assert_blocks_equal(caches, [4, 6, 8], restored, [0, 1, 2])
    finally:
        tier.close()


# ---- what sits at the tier's file names is never followed (issue 21 item 9) ---------------------------------
def _assert_cold_and_working(tier: KVTier, tmp_path: os.PathLike[str]) -> None:
    """A cold tier on an unnamed file: usable for this run, persists nothing, leaves no file behind."""
    g = tier.geometry
    try:
        assert tier.kind == "disk" and not tier.persistent and tier.load_index() == []
        src, dst = random_caches(g, seed=3), random_caches(g, seed=4)
        tier.store(src, pairs([(0, 3)]))
        tier.load(dst, pairs([(3, 5)]))
        assert_blocks_equal(src, [0], dst, [5])
        tier.save_index(entries_for(g))  # a no-op: nothing vouches for an unnamed file
    finally:
        tier.close()
    assert not os.path.lexists(os.path.join(tmp_path, f"{FP}.idx"))


@pytest.mark.parametrize("target_exists", [True, False])
def test_symlinked_data_file_is_never_followed(target_exists, tmp_path, caplog):
    """`ln -s /some/file DIR/<fingerprint>.kv` used to resize the target to the tier's size and overwrite it; a
    dangling link created the target (or failed the start)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "precious"
    if target_exists:
        target.write_bytes(b"keep me")
    tier_dir = tmp_path / "tier"
    tier_dir.mkdir()
    (tier_dir / f"{FP}.kv").symlink_to(target)
    with caplog.at_level(logging.WARNING):
        tier = make_tier("disk", geometry(), tier_dir)
    assert "starts cold" in caplog.text
    _assert_cold_and_working(tier, tier_dir)
    assert (tier_dir / f"{FP}.kv").is_symlink()  # left as it was
    if target_exists:
        assert target.read_bytes() == b"keep me"
    else:
        assert not target.exists()
    assert sorted(p.name for p in tier_dir.iterdir()) == [f"{FP}.kv"]  # the unnamed file is gone with the tier


@pytest.mark.parametrize("what", ["folder", "fifo", "hardlink"])
def test_non_regular_data_file_starts_cold(what, tmp_path, caplog):
    path = tmp_path / f"{FP}.kv"
    other = tmp_path / "other"
    if what == "folder":
        path.mkdir()
    elif what == "fifo":
        os.mkfifo(path)
    else:
        other.write_bytes(b"another file's bytes")
        os.link(other, path)
    with caplog.at_level(logging.WARNING):
        tier = make_tier("disk", geometry(), tmp_path)
    assert "starts cold" in caplog.text
    _assert_cold_and_working(tier, tmp_path)
    if what == "hardlink":
        assert other.read_bytes() == b"another file's bytes"


def test_fifo_or_symlink_at_the_index_is_ignored_without_blocking(tmp_path, caplog):
    """A FIFO at `.idx` hung the start for ever (open() waits for a writer): it is refused, not read."""
    import threading

    g, _, _ = saved_tier(tmp_path)
    index = tmp_path / f"{FP}.idx"
    index.unlink()
    os.mkfifo(index)
    tier = make_tier("disk", g, tmp_path)
    try:
        result: list[object] = []
        with caplog.at_level(logging.WARNING):
            reader = threading.Thread(target=lambda: result.append(tier.load_index()), daemon=True)
            reader.start()
            reader.join(10)
        assert not reader.is_alive() and result == [[]]
        assert "not a regular file" in caplog.text
        tier.save_index(entries_for(g))  # the rename replaces the FIFO with a real index
        assert index.is_file() and not index.is_symlink()
    finally:
        tier.close()
    outside = tmp_path / "outside.idx"
    outside.write_bytes(b"not ours")
    index.unlink()
    index.symlink_to(outside)
    tier = make_tier("disk", g, tmp_path)
    try:
        assert tier.load_index() == []
        tier.save_index(entries_for(g))
    finally:
        tier.close()
    assert outside.read_bytes() == b"not ours" and index.is_file() and not index.is_symlink()
