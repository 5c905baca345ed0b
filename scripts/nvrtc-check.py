#!/usr/bin/env python3
"""Compile the CUDA kernel sources that oomfix compiles at run time with NVRTC,
so that a source error shows on the build machine instead of on the GPU.

Usage: nvrtc-check.py LIBNVRTC PRELUDE SOURCE[@ARCH]...

Each SOURCE is compiled after PRELUDE (the 16-bit prelude, as the crates do),
with --gpu-architecture=ARCH when given (e.g. compute_90) and NVRTC's default
otherwise. Prints each compiler log; exits 1 if any source fails.
"""
import ctypes
import sys


def compile_source(lib, code, name, arch):
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), code, name.encode(), 0, None, None):
        raise RuntimeError(f"nvrtcCreateProgram failed for {name}")
    opts = [f"--gpu-architecture={arch}".encode()] if arch else []
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace").strip()


def main(argv):
    if len(argv) < 4:
        print(__doc__, file=sys.stderr)
        return 2
    lib = ctypes.CDLL(argv[1])
    prelude = open(argv[2]).read()
    failed = 0
    for spec in argv[3:]:
        path, _, arch = spec.partition("@")
        rc, log = compile_source(lib, (prelude + open(path).read()).encode(), path, arch)
        print(f"nvrtc {path}{' (' + arch + ')' if arch else ''}: {'ok' if rc == 0 else 'FAILED'}")
        if log:
            print(log)
        failed += rc != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
