"""The CRC-32 check of a checkpoint file's records on several threads: chunk CRCs joined exactly as zlib
computes the whole, a damaged chunk anywhere in a record named, a record reaching past the file refused."""
import os
import random
import struct
import zipfile
import zlib

import pytest
import torch

from lazytrain.engine import record_crc


def test_crc32_combine_equals_zlib_over_the_concatenation():
    rng = random.Random(0)
    for _ in range(200):
        a = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 200)))
        b = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 200)))
        assert record_crc.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    big = os.urandom(3 << 20)   # lengths with many bits set, as a record's last chunk has
    for cut in (1, 4095, (1 << 20) + 7, (3 << 20) - 1):
        assert record_crc.crc32_combine(zlib.crc32(big[:cut]), zlib.crc32(big[cut:]), len(big) - cut) == zlib.crc32(big)


def _record_span(path, name_part):
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if name_part in i.filename and i.file_size > 0)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    return info, info.header_offset + 30 + name_len + extra_len


@pytest.mark.parametrize("threads", [1, 3])
def test_a_record_checked_in_many_chunks_passes_whole_and_fails_at_any_damaged_byte(tmp_path, monkeypatch, threads):
    monkeypatch.setattr(record_crc, "CHUNK_BYTES", 1000)   # a 40,000-byte record in 40 tasks on the pool, the small
    # records packed into tasks of their own
    path = str(tmp_path / "state.pt")
    torch.save({"w": torch.arange(10_000, dtype=torch.float32), "b": torch.ones(3)}, path)
    record_crc.check_records(path, threads=threads)
    info, first = _record_span(path, "/data/0")
    assert info.file_size == 40_000
    for at in (0, 999, 1000, 23_456, 39_999):   # the first and last bytes, chunk edges, a middle
        with open(path, "r+b") as f:
            f.seek(first + at)
            was = f.read(1)
            f.seek(first + at)
            f.write(bytes([was[0] ^ 0x10]))
        with pytest.raises(record_crc.RecordCheckError, match=f"^Bad CRC-32 for file '{info.filename}'$"):
            record_crc.check_records(path, threads=threads)
        with open(path, "r+b") as f:
            f.seek(first + at)
            f.write(was)
        record_crc.check_records(path, threads=threads)
    # a small record read in one task with the others beside it (the pickle, the byte order, "b"): named alone
    small, first = _record_span(path, "/data/1")
    assert small.file_size == 12
    with open(path, "r+b") as f:
        f.seek(first + 5)
        f.write(b"\x7f")
    with pytest.raises(record_crc.RecordCheckError, match=f"^Bad CRC-32 for file '{small.filename}'$"):
        record_crc.check_records(path, threads=threads)


def test_a_record_the_directory_says_reaches_past_the_end_of_the_file_is_refused(tmp_path):
    path = str(tmp_path / "state.pt")
    torch.save({"w": torch.arange(64, dtype=torch.float32)}, path)
    info, _ = _record_span(path, "/data/0")
    with zipfile.ZipFile(path) as z:
        start_dir = z.start_dir
        names = [i.filename for i in z.infolist()]
    with open(path, "r+b") as f:   # its central directory entry: sizes at 20 and 24
        f.seek(start_dir)
        for name in names:
            entry = f.tell()
            fixed = f.read(46)
            n, e, c = struct.unpack("<HHH", fixed[28:34])
            if f.read(n).decode() == info.filename:
                f.seek(entry + 20)
                f.write(struct.pack("<II", 1 << 30, 1 << 30))
                break
            f.seek(e + c, os.SEEK_CUR)
    with pytest.raises(record_crc.RecordCheckError,
                       match=f"^record '{info.filename}' reaches past the end of the file$"):
        record_crc.check_records(path)


def test_records_saved_without_crcs_are_not_checked(tmp_path):
    import io
    torch.serialization.set_crc32_options(False)
    try:
        buffer = io.BytesIO()
        torch.save({"w": torch.arange(64, dtype=torch.float32)}, buffer)
    finally:
        torch.serialization.set_crc32_options(True)
    path = str(tmp_path / "no-crc.pt")
    with open(path, "wb") as f:
        f.write(buffer.getvalue())
    record_crc.check_records(path)


def test_a_damaged_compressed_record_is_named_not_taken_for_a_file_that_is_no_zip(tmp_path):
    """torch writes stored records only; a compressed one is checked by zipfile's reader, whose bad-CRC error
    is a BadZipFile: it must not read as "no zip file" (left to torch unchecked)."""
    path = str(tmp_path / "deflated.zip")
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data/0", bytes(range(256)) * 64)
    with zipfile.ZipFile(path) as z:
        info = z.infolist()[0]
    with open(path, "r+b") as f:   # the CRC the directory keeps for it, wrong
        f.seek(z.start_dir + 16)
        f.write(struct.pack("<I", info.CRC ^ 1))
    with pytest.raises(record_crc.RecordCheckError, match="^Bad CRC-32 for file 'archive/data/0'$"):
        record_crc.check_records(path)


def test_records_that_overlap_or_share_a_header_are_refused(tmp_path):
    """A zip may place one record's bytes inside another's, or list one record under many names (zipfile reads
    them all); torch writes neither, and each was checked again: 2000 names of one 4 MB record took 2000
    reads (a file of 100 MB so would take hours)."""
    def local(name, data):
        return struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, 0, 0, 0, zlib.crc32(data), len(data), len(data),
                           len(name), 0) + name + data

    def central(name, data, offset):
        return struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, zlib.crc32(data), len(data),
                           len(data), len(name), 0, 0, 0, 0, 0, offset) + name
    outer = b"\0" * 5 + local(b"B", b"b" * 10) + b"\0" * 200   # B's header and bytes 5 bytes into A's
    blob = local(b"A", outer)
    directory = central(b"A", outer, 0) + central(b"B", b"b" * 10, 30 + 1 + 5)
    path = tmp_path / "inside.zip"
    path.write_bytes(blob + directory + struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 2, 2, len(directory),
                                                    len(blob), 0))
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
    with pytest.raises(record_crc.RecordCheckError, match="^records 'A' and 'B' overlap \\(not a file torch writes\\)$"):
        record_crc.check_records(str(path))
    data = b"d" * 64   # one record under two names
    blob = local(b"C", data)
    directory = central(b"C", data, 0) + central(b"D", data, 0)
    path.write_bytes(blob + directory + struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 2, 2, len(directory),
                                                    len(blob), 0))
    with pytest.raises(record_crc.RecordCheckError, match="^records 'C' and 'D' are one record listed twice"):
        record_crc.check_records(str(path))
