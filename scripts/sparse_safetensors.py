"""Safetensors files whose data region is a hole: a real header over data
that reads as zeros and takes no disk, for planning and timing without
weights (make-sparse-llama.py, make-sparse-gpt2.py, make-hub-shape.py)."""
import json
import os
import struct

BYTES = {"BF16": 2, "F16": 2, "F32": 4}


def write(path, entries, dtype="BF16"):
    """Write the tensors `entries` ((name, shape) pairs), all `dtype`, to
    `path` (under a temporary name, then renamed); returns the number of
    values and the data region's bytes."""
    header, offset, values = {}, 0, 0
    for name, shape in entries:
        n = 1
        for d in shape:
            n *= d
        values += n
        size = n * BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        f.truncate(8 + len(blob) + offset)
    os.replace(tmp, path)
    return values, offset
