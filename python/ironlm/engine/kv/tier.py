"""The KV tier below the device pool: host memory (pinned on GPU) or a memory-mapped file that survives restarts.

The Rust core decides what moves (SchedulerPlan.kv_demote / kv_promote, tier_flush) and which slot holds which
block; this module only stores bytes and, for the disk tier, persists the core's index of them. Layout is one tensor
[num_slots, num_layers, planes, block_size, num_kv_heads, head_dim] (planes: K and V, or the one latent plane of
multi-head latent attention, whose K and V caches are one tensor): slot-major, so one slot is one contiguous byte range
(a per-slot checksum is one pass over it, a slot's pages are local in the file, and one DMA moves it on GPU).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import json
import logging
import os
import stat
import struct
import tempfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np
import torch

from ironlm import _core
from ironlm.core_views import indexable
from ironlm.engine.kv_cache import KVCaches
from ironlm.exceptions import InvalidArgumentError

logger = logging.getLogger(__name__)

# (slot, parent_slot or -1, namespace, the block's block_size token ids): the core's tier_entries() rows.
TierEntry = tuple[int, int, str | None, list[int]]

_INDEX_MAGIC = b"IRLMKVIX"
_INDEX_VERSION = 1
# magic, version, body length, blake2b-128 of the body: the digest makes a truncated or bit-flipped body (whose
# token ids would otherwise silently name the wrong KV) fail before json ever sees it.
_INDEX_HEADER = struct.Struct("<8sIQ16s")
_HASH_CHUNK = 4 << 20


@dataclass(frozen=True)
class TierGeometry:
    """What one block of the device pool holds; a tier is usable only by a pool of the same geometry."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    planes: int = 2  # K and V; 1 = latent attention (the pool's K and V are one tensor)

    def __post_init__(self) -> None:
        if self.planes not in (1, 2):
            raise InvalidArgumentError(f"planes must be 1 or 2, got {self.planes!r}", param="planes")
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}", param=name)
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise InvalidArgumentError(f"dtype must be a floating torch.dtype, got {self.dtype!r}", param="dtype")

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.planes * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def to_json(self) -> dict[str, object]:
        fields = asdict(self)
        fields["dtype"] = self.dtype_name
        if self.planes == 2:  # the layout before latent attention existed: its disk tiers keep their fingerprints
            del fields["planes"]
        return fields


class VocabSource(Protocol):
    """Anything with a vocabulary: a transformers tokenizer, or a test double."""

    def get_vocab(self) -> dict[str, int]: ...


def _hash_file(update: Callable[[bytes | memoryview], None], path: str) -> None:
    """Every byte, and the size (a length prefix: files hashed one after another cannot run into each other)."""
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb") as f:
        update(os.fstat(f.fileno()).st_size.to_bytes(8, "little"))
        while n := f.readinto(buf):
            update(view[:n])


def fingerprint(model_path: str | os.PathLike[str], tokenizer: VocabSource | None, geometry: TierGeometry, *,
                quantization: str, quantization_group_size: int | None = None, tp_rank: int = 0,
                tp_size: int = 1, salt: str = "") -> str:
    """A 32-hex-digit key naming a disk tier's files: KV bytes are reusable only when every input that shaped
    them is the same.

    - `model_path` (HF folder or GGUF file): the weights compute the KV. Per file: relative name, size and every
      byte, so a fine-tune that changed any tensor never reuses the old KV (sampled chunks missed most tensors).
      One sequential read just after the loader read the same files (mostly from the page cache), only when a
      disk tier is configured: 1.2 s per 270 MB measured on a busy 2-core CPU. Modification times are left out on purpose: copying a model
      folder must not throw the cache away. Hidden entries (`.git`, huggingface's `.cache` download metadata)
      are skipped: they change without the weights.
    - `tokenizer`: its sorted vocabulary. The index stores token ids, so a different vocab makes them name other
      text; and a tokenizer loaded from elsewhere than `model_path` is not covered by the file hashes.
    - `geometry` (dtype, block_size, layers, KV heads, head dim): the byte layout of a slot.
    - `quantization`, `quantization_group_size`: quantizing the linears at load changes the activations, hence the
      KV, although the files on disk are the same.
    - `tp_rank`, `tp_size`: each tensor-parallel rank keeps its own shard of the KV heads in its own file.
    - `salt`: the operator's cache salt, to keep tenants' caches apart or force a cold start.
    - ironlm's version: the KV also depends on the code that computed it (RoPE, norms, kernels' conventions).
    """
    h = hashlib.blake2b(digest_size=16)

    def put(label: str, value: object) -> None:
        h.update(f"{label}={value!r}\0".encode())

    path = os.fspath(model_path)
    if os.path.isdir(path):
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(files):
                if name.startswith("."):
                    continue
                full = os.path.join(root, name)
                put("file", os.path.relpath(full, path).replace(os.sep, "/"))
                _hash_file(h.update, full)
    elif os.path.isfile(path):
        put("file", os.path.basename(path))
        _hash_file(h.update, path)
    else:
        raise InvalidArgumentError(f"model path {path!r} is neither a file nor a folder", param="model")
    if tokenizer is None:
        put("vocab", None)
    else:
        vocab = hashlib.blake2b(digest_size=16)
        for token, token_id in sorted(tokenizer.get_vocab().items()):
            vocab.update(f"{token_id}\0{token}\0".encode("utf-8", "surrogatepass"))
        put("vocab", vocab.hexdigest())
    put("geometry", sorted(geometry.to_json().items()))
    put("quantization", (quantization, quantization_group_size))
    put("tp", (tp_rank, tp_size))
    put("salt", salt)
    put("ironlm", _core.__version__)
    return h.hexdigest()


def _runs(sorted_slots: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) row ranges of `sorted_slots` whose slots are consecutive: each is one contiguous tier range."""
    breaks = np.flatnonzero(np.diff(sorted_slots) != 1) + 1
    bounds = [0, *breaks.tolist(), len(sorted_slots)]
    return list(itertools.pairwise(bounds))


class KVTier:
    """Slots of whole KV blocks (all layers, keys and values) below the device pool.

    Build with `KVTier.memory(...)` or `KVTier.disk(...)`. `store`/`load` copy blocks between the device pool and
    slots as the core's plan says; `save_index`/`load_index` persist the core's tier entries (disk tier only).
    """

    def __init__(self, kind: str, geometry: TierGeometry, num_slots: int, data: torch.Tensor, *,
                 raw: np.memmap | None = None, directory: str | None = None, fingerprint: str | None = None,
                 lock_fd: int | None = None) -> None:
        self.kind = kind
        self.geometry = geometry
        self.num_slots = num_slots
        # A disk tier on an unnamed file (its name was taken, see `disk`) works for this run only.
        self.persistent = raw is not None and directory is not None
        self._data = data
        self._raw = raw  # the disk tier's byte view: msync and per-slot checksums
        self._directory = directory
        self._fingerprint = fingerprint
        self._lock_fd = lock_fd
        self._closed = False
        self._cuda_used = False  # copies may still be in flight on a CUDA stream: synchronize before host reads

    @property
    def shape(self) -> tuple[int, ...]:
        g = self.geometry
        return (self.num_slots, g.num_layers, g.planes, g.block_size, g.num_kv_heads, g.head_dim)

    @property
    def data_path(self) -> str | None:
        if self._directory is None:
            return None
        return os.path.join(self._directory, f"{self._fingerprint}.kv")

    @property
    def index_path(self) -> str | None:
        if self._directory is None:
            return None
        return os.path.join(self._directory, f"{self._fingerprint}.idx")

    @classmethod
    def memory(cls, geometry: TierGeometry, num_slots: int, device: torch.device) -> KVTier:
        """Host memory, pinned when the pool is on CUDA so that copies are DMA and overlap the forward."""
        _check_slots(num_slots)
        pin = device.type == "cuda" and torch.cuda.is_available()
        shape = (num_slots, geometry.num_layers, geometry.planes, geometry.block_size, geometry.num_kv_heads, geometry.head_dim)
        # empty, not zeros: zeroing many GiB costs seconds, and the core never loads a slot it has not stored.
        data = torch.empty(shape, dtype=geometry.dtype, pin_memory=pin)
        return cls("memory", geometry, num_slots, data)

    @classmethod
    def disk(cls, geometry: TierGeometry, num_slots: int, directory: str, fingerprint: str) -> KVTier:
        """A file `<directory>/<fingerprint>.kv` of exactly num_slots slots, memory-mapped (the page cache is the
        working copy; the kernel writes it back). Locked for this process: two servers sharing one file would
        overwrite each other's slots.

        The name is never followed: a symlink, a folder, a FIFO or a file with other hard links there would make
        the tier resize and overwrite something that is not its own. Then the tier starts cold, with a warning,
        on an unnamed file in the same folder, which this run uses and nobody else sees (nothing persists)."""
        _check_slots(num_slots)
        if not fingerprint or not all(c in "0123456789abcdef" for c in fingerprint):
            raise InvalidArgumentError(f"fingerprint must be a hex digest, got {fingerprint!r}",
                                       param="fingerprint")
        path = os.path.join(directory, f"{fingerprint}.kv")
        try:
            os.makedirs(directory, exist_ok=True)
            fd = _open_regular(path, os.O_RDWR | os.O_CREAT)
            if fd is None:
                logger.warning("KV tier: %s is not a regular file of its own (a symlink, folder, FIFO or hard "
                               "link); left as it is, this run starts cold on an unnamed file and saves nothing",
                               path)
                fd, unnamed = tempfile.mkstemp(prefix=f".{fingerprint}.", suffix=".kv", dir=directory)
                os.unlink(unnamed)
                return cls._map(geometry, num_slots, fd, directory, None)
        except OSError as e:
            raise InvalidArgumentError(f"kv_offload_dir {directory!r} is not a writable folder: {e}",
                                       param="kv_offload_dir") from e
        return cls._map(geometry, num_slots, fd, directory, fingerprint)

    @classmethod
    def _map(cls, geometry: TierGeometry, num_slots: int, fd: int, directory: str,
             fingerprint: str | None) -> KVTier:
        """Lock, size and map the open data file `fd` (owned from here on); `fingerprint` None: an unnamed file."""
        size = num_slots * geometry.bytes_per_block
        path = os.path.join(directory, f"{fingerprint}.kv") if fingerprint else directory
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                raise InvalidArgumentError(f"kv_offload_dir: {path} is in use by another ironlm process",
                                           param="kv_offload_dir") from e
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)  # a resized tier: slots past the end are lost, load_index drops them
            try:
                # Reserve the blocks now: writing a sparse mmapped page on a full disk is a SIGBUS, not an error.
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise InvalidArgumentError(f"kv_offload_size: {size} bytes do not fit in {directory!r}",
                                               param="kv_offload_size") from e
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # no fallocate on this filesystem: go on
                    raise
            if os.fstat(fd).st_size != size:
                raise InvalidArgumentError(f"kv_offload_dir: {path} could not be sized to {size} bytes",
                                           param="kv_offload_dir")
            # Mapped from the descriptor checked above, never by name again (the name could be swapped meanwhile).
            with os.fdopen(os.dup(fd), "r+b") as f:
                raw = np.memmap(f, dtype=np.uint8, mode="r+", shape=(num_slots, geometry.bytes_per_block))
        except BaseException:
            os.close(fd)
            raise
        # numpy has no bf16: map bytes, reinterpret in torch (the last dim is contiguous, so view(dtype) is free).
        data = torch.from_numpy(raw).view(geometry.dtype).view(
            num_slots, geometry.num_layers, geometry.planes, geometry.block_size, geometry.num_kv_heads, geometry.head_dim)
        return cls("disk", geometry, num_slots, data, raw=raw, directory=directory if fingerprint else None,
                   fingerprint=fingerprint, lock_fd=fd)

    # ---- copies -------------------------------------------------------------------------------------------------

    def store(self, kv_caches: KVCaches, pairs: np.ndarray) -> None:
        """Device -> tier: rows (device_block, slot)."""
        blocks, slots = self._check(kv_caches, pairs, block_col=0)
        if len(slots) == 0:
            return
        if kv_caches[0][0].device.type == "cpu":
            src = torch.from_numpy(blocks)
            dst = torch.from_numpy(slots)
            for layer, (k, v) in enumerate(kv_caches):
                indexable(self._data[:, layer, 0]).index_copy_(0, dst, indexable(k).index_select(0, src))
                if v is not k:
                    indexable(self._data[:, layer, 1]).index_copy_(0, dst, indexable(v).index_select(0, src))
        else:
            self._store_runs(kv_caches, blocks, slots)

    def load(self, kv_caches: KVCaches, pairs: np.ndarray) -> None:
        """Tier -> device: rows (slot, device_block)."""
        blocks, slots = self._check(kv_caches, pairs, block_col=1)
        if len(slots) == 0:
            return
        if kv_caches[0][0].device.type == "cpu":
            src = torch.from_numpy(slots)
            dst = torch.from_numpy(blocks)
            for layer, (k, v) in enumerate(kv_caches):
                indexable(k).index_copy_(0, dst, indexable(self._data[:, layer, 0]).index_select(0, src))
                if v is not k:
                    indexable(v).index_copy_(0, dst, indexable(self._data[:, layer, 1]).index_select(0, src))
        else:
            self._load_runs(kv_caches, blocks, slots)

    # A device pool is layer-major and the tier slot-major, and a host tensor cannot be scattered into from a
    # kernel: gather the blocks on the device into slot-major order, then one DMA per run of consecutive slots
    # straight into (out of) the pinned tier. Everything is queued on the current stream, so it is ordered before
    # the forward that reuses the demoted blocks or reads the promoted ones, and the host never waits.

    def _store_runs(self, kv_caches: KVCaches, blocks: np.ndarray, slots: np.ndarray) -> None:
        order = np.argsort(slots, kind="stable")
        blocks, slots = blocks[order], slots[order]
        device = kv_caches[0][0].device
        self._cuda_used |= device.type == "cuda"
        index = torch.from_numpy(blocks).to(device)
        staged = torch.empty((len(slots), *self.shape[1:]), dtype=self.geometry.dtype, device=device)
        for layer, (k, v) in enumerate(kv_caches):
            staged[:, layer, 0] = k.index_select(0, index)
            if v is not k:
                staged[:, layer, 1] = v.index_select(0, index)
        pinned = self._data.is_pinned()
        for start, end in _runs(slots):
            first = int(slots[start])
            self._data[first:first + end - start].copy_(staged[start:end], non_blocking=pinned)

    def _load_runs(self, kv_caches: KVCaches, blocks: np.ndarray, slots: np.ndarray) -> None:
        order = np.argsort(slots, kind="stable")
        blocks, slots = blocks[order], slots[order]
        device = kv_caches[0][0].device
        self._cuda_used |= device.type == "cuda"
        staged = torch.empty((len(slots), *self.shape[1:]), dtype=self.geometry.dtype, device=device)
        pinned = self._data.is_pinned()
        for start, end in _runs(slots):
            first = int(slots[start])
            staged[start:end].copy_(self._data[first:first + end - start], non_blocking=pinned)
        index = torch.from_numpy(blocks).to(device)
        for layer, (k, v) in enumerate(kv_caches):
            indexable(k).index_copy_(0, index, indexable(staged[:, layer, 0]))
            if v is not k:
                indexable(v).index_copy_(0, index, indexable(staged[:, layer, 1]))

    def _check(self, kv_caches: KVCaches, pairs: np.ndarray, block_col: int) -> tuple[np.ndarray, np.ndarray]:
        """(device blocks, slots) as contiguous int64 arrays, after range checks: an index torch does not bound
        (a slice start, a negative index) must never write into the wrong bytes."""
        if self._closed:
            raise RuntimeError("KVTier is closed")
        pairs = np.asarray(pairs)
        if pairs.size == 0:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty
        if pairs.ndim != 2 or pairs.shape[1] != 2 or pairs.dtype.kind not in "iu":
            raise InvalidArgumentError(f"pairs must be an integer array [k, 2], got {pairs.dtype} {pairs.shape}",
                                       param="pairs")
        g = self.geometry
        if len(kv_caches) != g.num_layers:
            raise InvalidArgumentError(f"kv_caches has {len(kv_caches)} layers, the tier {g.num_layers}",
                                       param="kv_caches")
        k0 = kv_caches[0][0]
        if g.planes == 1 and kv_caches[0][1] is not k0:
            raise InvalidArgumentError("a one-plane (latent attention) tier needs caches whose K and V are one "
                                       "tensor", param="kv_caches")
        if tuple(k0.shape[1:]) != (g.block_size, g.num_kv_heads, g.head_dim) or k0.dtype != g.dtype:
            raise InvalidArgumentError(f"kv_caches blocks are {k0.dtype} {tuple(k0.shape[1:])}, the tier's "
                                       f"{g.dtype} {(g.block_size, g.num_kv_heads, g.head_dim)}",
                                       param="kv_caches")
        blocks = np.ascontiguousarray(pairs[:, block_col], dtype=np.int64)
        slots = np.ascontiguousarray(pairs[:, 1 - block_col], dtype=np.int64)
        for name, values, bound in (("device block", blocks, k0.shape[0]), ("tier slot", slots, self.num_slots)):
            low, high = int(values.min()), int(values.max())
            if low < 0 or high >= bound:
                raise InvalidArgumentError(f"pairs: {name} out of range [0, {bound}): {low if low < 0 else high}",
                                           param="pairs")
        return blocks, slots

    # ---- persistence --------------------------------------------------------------------------------------------

    def _sync(self) -> None:
        if self._cuda_used and torch.cuda.is_available():
            torch.cuda.synchronize()  # DMA into the tier may still be in flight
        if self._raw is not None:
            self._raw.flush()  # msync: the data must be on disk before an index vouches for it

    def _slot_checksum(self, slot: int) -> int:
        assert self._raw is not None
        return zlib.crc32(self._raw[slot])

    def save_index(self, entries: Sequence[TierEntry]) -> None:
        """Write `<dir>/<fingerprint>.idx` for `entries` (the core's tier_entries(), after the tier_flush copies):
        atomically (temp file, fsync, rename), so a crash leaves either no index or a whole one. No-op for the
        memory tier, which has nothing to keep across a restart."""
        if self._closed:
            raise RuntimeError("KVTier is closed")
        if not self.persistent:
            return
        self._sync()
        rows = []
        for slot, parent, namespace, tokens in entries:
            if not 0 <= slot < self.num_slots:
                raise InvalidArgumentError(f"entries: slot {slot} out of range [0, {self.num_slots})",
                                           param="entries")
            rows.append([int(slot), int(parent), namespace, [int(t) for t in tokens], self._slot_checksum(slot)])
        body = json.dumps({
            "fingerprint": self._fingerprint,
            "geometry": self.geometry.to_json(),
            "num_slots": self.num_slots,
            "checksum": "crc32",
            "entries": rows,
        }, separators=(",", ":")).encode()
        header = _INDEX_HEADER.pack(_INDEX_MAGIC, _INDEX_VERSION, len(body),
                                    hashlib.blake2b(body, digest_size=16).digest())
        path = self.index_path
        assert path is not None and self._directory is not None
        tmp = f"{path}.tmp.{os.getpid()}"
        try:
            fd = _open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            if fd is None:
                raise OSError(f"{tmp} is not a regular file")
            with os.fdopen(fd, "wb") as f:
                f.write(header + body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # a symlink or FIFO at `path` is replaced, never written through
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        # The rename itself must reach the disk, or a power loss could keep the old (or no) index.
        dir_fd = os.open(self._directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def load_index(self) -> list[TierEntry]:
        """The entries of the index left by the last clean shutdown, each checked against the bytes of its slot,
        then the index file is deleted: from now on the data file changes under it, and after a crash it would
        vouch for bytes it never saw. Anything wrong is logged and dropped -- a foreign, stale or corrupt file
        yields [] -- never raised. Descendants of a dropped entry are dropped too (parents come first)."""
        path = self.index_path
        if not self.persistent or self._closed or path is None:
            return []
        try:
            fd = _open_regular(path, os.O_RDONLY)
            if fd is None:  # a FIFO would block the start for ever; a symlink could point anywhere
                logger.warning("KV tier index %s is not a regular file of its own, ignored, starting cold", path)
                return []
            with os.fdopen(fd, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            return []
        except OSError as e:
            logger.warning("KV tier index %s unreadable, starting cold: %s", path, e)
            return []
        try:
            os.unlink(path)
        except OSError as e:
            # An index that cannot be deleted would be trusted again after a crash: do not trust it now either.
            logger.warning("KV tier index %s cannot be deleted, ignoring it: %s", path, e)
            return []
        rows = self._parse_index(path, blob)
        if isinstance(rows, str):
            logger.warning("KV tier index %s ignored (%s), starting cold", path, rows)
            return []
        return self._validate_entries(path, rows)

    def _parse_index(self, path: str, blob: bytes) -> list[object] | str:
        """The index's entry rows, or why the whole file is rejected."""
        if len(blob) < _INDEX_HEADER.size:
            return "truncated header"
        magic, version, length, digest = _INDEX_HEADER.unpack_from(blob)
        if magic != _INDEX_MAGIC:
            return "not an ironlm KV index: bad magic"
        if version != _INDEX_VERSION:
            return f"format version {version}, this ironlm reads {_INDEX_VERSION}"
        body_bytes = blob[_INDEX_HEADER.size:]
        if len(body_bytes) != length:
            return f"truncated: {len(body_bytes)} of {length} body bytes"
        if hashlib.blake2b(body_bytes, digest_size=16).digest() != digest:
            return "body checksum mismatch"
        try:
            body = json.loads(body_bytes)
        except (ValueError, RecursionError) as e:
            return f"unparsable: {e}"
        if not isinstance(body, dict):
            return "unparsable: not an object"
        if body.get("fingerprint") != self._fingerprint:
            return f"foreign fingerprint {body.get('fingerprint')!r}"
        if body.get("geometry") != self.geometry.to_json():
            return f"geometry {body.get('geometry')!r} differs from {self.geometry.to_json()!r}"
        if body.get("checksum") != "crc32" or not isinstance(body.get("entries"), list):
            return "unparsable: no crc32 entries"
        if body.get("num_slots") != self.num_slots:
            logger.info("KV tier index %s: tier resized from %r to %d slots", path, body.get("num_slots"),
                        self.num_slots)
        rows: list[object] = body["entries"]
        return rows

    def _validate_entries(self, path: str, rows: list[object]) -> list[TierEntry]:
        kept: list[TierEntry] = []
        kept_slots: set[int] = set()
        malformed = corrupt = orphaned = gone = 0
        block_size = self.geometry.block_size
        for row in rows:
            if not (isinstance(row, list) and len(row) == 5):
                malformed += 1
                continue
            slot, parent, namespace, tokens, checksum = row
            if _is_int(slot) and slot >= self.num_slots:
                gone += 1  # the tier was restarted smaller: that slot was cut off the file
                continue
            if not (_is_int(slot) and slot >= 0 and slot not in kept_slots
                    and _is_int(parent) and parent >= -1 and _is_int(checksum)
                    and (namespace is None or isinstance(namespace, str))
                    and isinstance(tokens, list) and len(tokens) == block_size
                    and all(_is_int(t) and t >= 0 for t in tokens)):
                malformed += 1
                continue
            if parent != -1 and parent not in kept_slots:
                orphaned += 1
                continue
            if self._slot_checksum(slot) != checksum:
                logger.warning("KV tier %s: slot %d fails its checksum, dropped with its descendants",
                               self.data_path, slot)
                corrupt += 1
                continue
            kept.append((slot, parent, namespace, tokens))
            kept_slots.add(slot)
        if malformed or corrupt or orphaned or gone:
            logger.warning("KV tier index %s: kept %d entries, dropped %d malformed, %d corrupt, %d orphaned, "
                           "%d past the resized tier's end", path, len(kept), malformed, corrupt, orphaned, gone)
        return kept

    def close(self) -> None:
        """Wait for copies in flight, write the mapping back and release the file lock. Idempotent."""
        if self._closed:
            return
        self._sync()
        self._closed = True
        # Drop the mapping before the lock: a later tier on this file must not see our pages still mapped.
        self._data = torch.empty(0, dtype=self.geometry.dtype)
        self._raw = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None


def _open_regular(path: str, flags: int) -> int | None:
    """`os.open(path)` for a regular file with no other name, or None for anything else there (a symlink, dangling
    or not, a folder, a FIFO, a device, a hard link to another file), which is left untouched. Never blocks (a FIFO
    opens non-blocking) and never follows a symlink. Other errors (permissions, a missing folder) raise."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as e:
        # ELOOP: a symlink; EISDIR: a folder; ENXIO: a FIFO opened for writing with no reader.
        if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            return None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        return None
    os.set_blocking(fd, True)
    return fd


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_slots(num_slots: int) -> None:
    if not _is_int(num_slots) or num_slots < 1:
        raise InvalidArgumentError(f"num_slots must be a positive integer, got {num_slots!r}", param="num_slots")
