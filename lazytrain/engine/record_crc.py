"""The CRC-32 check of a torch zip file's records, on several threads.

torch writes a CRC-32 for every record of a checkpoint file and its reader never checks them; a
memory-mapped load reads the bytes as they are, so a flipped bit would load as a wrong weight. Checking
means reading every byte once more, and one core computes CRC-32 at about 2.4 GB/s (the 2-core dev VM,
BENCHMARKS.md): a 100 GB checkpoint would take 40 s on one thread. The bytes are read in chunks on a
thread pool (``os.pread`` and ``zlib.crc32`` both release the GIL), and the CRCs of a record's chunks are
joined into the record's (:func:`crc32_combine`, zlib's algorithm), so one record of many gigabytes (a
DeepSpeed rank's flat fp32 partition) is checked on every thread too.
"""
from __future__ import annotations

import os
import struct
import threading
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor

CHUNK_BYTES = 16 << 20     # bytes one thread reads and checks at a time (its buffer)
MAX_THREADS = 8            # beyond this a host's storage, not its cores, bounds the check


class RecordCheckError(ValueError):
    """A record whose bytes do not match its CRC-32, or that reaches past the end of the file."""


def _gf2_times(matrix: tuple[int, ...], vector: int) -> int:
    """A 32x32 matrix over GF(2) (its columns: the images of each bit) times a 32-bit vector."""
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _compose(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """The operator that applies ``b``, then ``a``."""
    return tuple(_gf2_times(a, column) for column in b)


_ONE_ZERO_BIT = (0xEDB88320,) + tuple(1 << n for n in range(31))   # the reflected polynomial shifts in a 0 bit
_TWO_ZERO_BITS = _compose(_ONE_ZERO_BIT, _ONE_ZERO_BIT)
_FOUR_ZERO_BITS = _compose(_TWO_ZERO_BITS, _TWO_ZERO_BITS)
_ONE_ZERO_BYTE = _compose(_FOUR_ZERO_BITS, _FOUR_ZERO_BITS)


def _zero_byte_powers(count: int = 64) -> list[tuple[int, ...]]:
    """The operators that run a CRC-32 register through 1, 2, 4, ... 2**(count-1) zero bytes (squarings)."""
    powers = [_ONE_ZERO_BYTE]
    while len(powers) < count:
        powers.append(_compose(powers[-1], powers[-1]))
    return powers


_ZERO_BYTE_POWERS = _zero_byte_powers()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from A's (``crc1``), B's (``crc2``) and B's length: A's CRC run through ``len2``
    zero bytes, xor B's (zlib's crc32_combine: CRC-32 is linear over GF(2) once its pre- and
    post-inversions cancel, as they do between the two). The register is taken through the powers of two
    of zero bytes that ``len2`` is made of, one 32-bit product each: no matrix is built per length."""
    bit = 0
    while crc1 and len2 > 0:
        if len2 & 1:
            crc1 = _gf2_times(_ZERO_BYTE_POWERS[bit], crc1)
        len2 >>= 1
        bit += 1
    return crc1 ^ crc2


def _usable_cores() -> int:
    """The cores this process may run on (its affinity, as a container or ``taskset`` sets it)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:   # no affinity on this platform
        return os.cpu_count() or 1


def _tasks(spans: list) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
    """The work of the pool: pieces (record index, first byte, length) of at most CHUNK_BYTES each, in file
    order, packed into tasks (first byte, byte after the last, pieces) that span at most CHUNK_BYTES: a large
    record is read in chunks, and many small ones (a model file: a record per tensor) are read together, one
    read and one task for all of them."""
    pieces = sorted(((n, offset, min(CHUNK_BYTES, first + info.file_size - offset))
                     for n, (info, first) in enumerate(spans)
                     for offset in range(first, first + info.file_size, CHUNK_BYTES)), key=lambda p: p[1])
    tasks: list[tuple[int, int, list[tuple[int, int, int]]]] = []
    for piece in pieces:   # by first byte (records do not overlap: _refuse_overlaps)
        end = piece[1] + piece[2]
        if tasks and max(end, tasks[-1][1]) - tasks[-1][0] <= CHUNK_BYTES:
            first, last, packed = tasks[-1]
            packed.append(piece)
            tasks[-1] = (first, max(last, end), packed)
        else:
            tasks.append((piece[1], end, [piece]))
    return tasks


def first_byte(fd: int, info: zipfile.ZipInfo) -> int:
    """Where record ``info``'s bytes begin in the zip file open as ``fd``: past its local header, whose name
    and extra field (torch's alignment padding) may differ in length from the central directory's."""
    head = os.pread(fd, 30, info.header_offset)
    if len(head) < 30 or head[:4] != b"PK\x03\x04":
        raise RecordCheckError(f"record '{info.filename}' has no local header where the zip directory puts it")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _refuse_shared_headers(infos: list) -> None:
    """A zip directory may list one record under many names; torch never writes one so, and each name was
    checked again (2000 names of one 4 MB record: 2000 reads, a file of 100 MB so would take hours)."""
    seen: dict[int, str] = {}
    for info in infos:
        other = seen.setdefault(info.header_offset, info.filename)
        if other != info.filename:
            raise RecordCheckError(f"records '{other}' and '{info.filename}' are one record listed twice (not a "
                                   f"file torch writes)")


def _refuse_directories(infos: list) -> None:
    """A record flagged as a directory (a name ending in '/', or the MS-DOS directory bit of its external
    attributes): torch writes none, and its reader (miniz) reads no bytes for one, so the unpickler would go on
    with whatever its buffer held (one flipped bit of the zip directory; the error then differed run to run)."""
    for info in infos:
        if info.filename.endswith("/") or info.external_attr & 0x10:
            raise RecordCheckError(f"record '{info.filename}' is marked as a directory in the zip directory (not a "
                                   f"file torch writes)")


def _refuse_overlaps(spans: list) -> None:
    """Records whose bytes overlap (one inside another, under other headers): not a file torch writes, and
    checked once each, their bytes would be read many times over."""
    last_end, last_name = -1, None
    for info, first in sorted(spans, key=lambda span: span[1]):
        if first < last_end:
            raise RecordCheckError(f"records '{last_name}' and '{info.filename}' overlap (not a file torch writes)")
        last_end, last_name = first + info.file_size, info.filename


def check_records(path: str, threads: int | None = None) -> None:
    """Raise :class:`RecordCheckError` unless every record of zip file ``path`` holds the bytes its CRC-32
    says; ``zipfile.BadZipFile`` when it is no zip file. Records kept with a CRC of 0 (torch's
    ``set_crc32_options(False)``) are not checked; compressed ones (not torch's) are checked by zipfile's
    reader, on this thread."""
    threads = max(1, min(MAX_THREADS, _usable_cores()) if threads is None else threads)
    fd = os.open(path, os.O_RDONLY)   # one open file for the directory and the bytes: a file replaced meanwhile
    try:                              # is checked as the one whose directory was read
        with os.fdopen(os.dup(fd), "rb") as f, zipfile.ZipFile(f) as z:
            _refuse_directories(z.infolist())
            infos = [i for i in z.infolist() if i.CRC != 0 and i.file_size > 0]
            _refuse_shared_headers(infos)
            for info in infos:
                if info.compress_type != zipfile.ZIP_STORED:
                    try:
                        with z.open(info) as record:   # zipfile compares the CRC once it has read the whole record
                            while record.read(CHUNK_BYTES):
                                pass
                    except zipfile.BadZipFile as e:    # a record's, not "no zip file"
                        raise RecordCheckError(str(e)) from None
        stored = [i for i in infos if i.compress_type == zipfile.ZIP_STORED]
        size = os.fstat(fd).st_size
        spans = []   # (record, its first byte)
        for info in stored:
            first = first_byte(fd, info)
            if first + info.file_size > size:
                raise RecordCheckError(f"record '{info.filename}' reaches past the end of the file")
            spans.append((info, first))
        _refuse_overlaps(spans)
        tasks = _tasks(spans)
        local = threading.local()

        def crc_of(task):   # one read of the bytes the task spans, then each piece's CRC
            first, last, pieces = task
            buffer = getattr(local, "buffer", None)
            if buffer is None or len(buffer) < last - first:
                buffer = local.buffer = bytearray(max(CHUNK_BYTES, last - first))
            view = memoryview(buffer)[:last - first]
            got = 0
            while got < len(view):
                read = os.preadv(fd, [view[got:]], first + got)
                if read == 0:
                    raise RecordCheckError(f"record '{spans[max(pieces, key=lambda p: p[1] + p[2])[0]][0].filename}' "
                                           f"reaches past the end of the file")
                got += read
            return [(n, length, zlib.crc32(view[offset - first:offset - first + length]))
                    for n, offset, length in pieces]

        crcs = [0] * len(spans)
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lazytrain-crc") as pool:
            for done in pool.map(crc_of, tasks):   # in file order: each record's pieces joined as read
                for n, length, crc in done:
                    crcs[n] = crc32_combine(crcs[n], crc, length)
    finally:
        os.close(fd)
    for (info, _), crc in zip(spans, crcs):
        if crc != info.CRC:
            raise RecordCheckError(f"Bad CRC-32 for file '{info.filename}'")
