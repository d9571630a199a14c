#!/usr/bin/env python3
"""Where a kernel's code goes, by function and source line, from its PTX (docs/perf.md §5 item 36).
Needs no GPU: a kernel's instruction count is a proxy for the code its warps fetch, which DeepEP's
harness runs cold.

    nvcc <the build's flags> -arch=sm_90 -ptx -lineinfo -x cu src/cuda/ll.cu -o ll.ptx
    python3 bench/ptx_size.py ll.ptx [--kernel REGEX] [--top N]
    python3 bench/ptx_size.py --cubin A.cubin [B.cubin ...] [--kernel REGEX]

For every `.entry` whose (mangled or demangled) name matches REGEX: its PTX instruction count, then
the N functions and the N source lines (file:line) holding the most instructions. An instruction
belongs to the function and line of the `.loc` before it: the innermost inlined function
(`function_name` of the `.loc`, the mangled names held in `.debug_str`), or the kernel itself.
PTX is before ptxas (SASS counts differ), but the shares say which source is where the code is.

--cubin: the SASS bytes of every matching kernel (its `.text.<name>` section), by name, in each
cubin (`nvcc -cubin`, or `cuobjdump -xelf all` of a binary; `bench/gpu_run.sh ab` prints both
trees').

--cubin --sass: also each matching kernel's SASS instructions, counted per opcode (with its
modifiers, e.g. LDG.E.STRONG.SYS), from `nvdisasm -c` ($NVDISASM, else on PATH, else
/usr/local/cuda/bin). A machine without the CUDA toolkit's disassembler can use Debian's
(`nvidia-cuda-toolkit` 11.8 in bookworm's non-free component: `apt-get download` it and
`dpkg -x` the package, no install): that nvdisasm predates the ELF header that CUDA 12.8+ writes,
so the cubin is disassembled from a copy whose header is rewritten to the older form (the
sections, and so the SASS, are unchanged); an nvdisasm older than the cubin prints nothing for
the instructions it cannot decode, counted per kernel from the gaps in the addresses. `--listing`
prints the disassembly of the matching kernels as well.
"""
import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from collections import Counter

LOC = re.compile(r"\.loc\s+(\d+)\s+(\d+)\s+\d+(?:,\s*function_name\s+(\$L__info_string\d+))?")
FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"')
ENTRY = re.compile(r"^(?:\.\w+\s+)*\.entry\s+([A-Za-z0-9_$]+)")
INFO = re.compile(r"^(\$L__info_string\d+):\s*$")


def info_strings(lines):
    """{label: string} of the `.debug_str` section (`.b8` byte lists ending in 0)."""
    out, label, data = {}, None, []
    for line in lines:
        m = INFO.match(line.strip())
        if m:
            label, data = m.group(1), []
            continue
        s = line.strip()
        if label and s.startswith(".b8"):
            data += [int(b) for b in s[3:].replace(" ", "").split(",") if b]
            if data and data[-1] == 0:
                out[label] = bytes(data[:-1]).decode("ascii", "replace")
                label = None
    return out


def demangle(names):
    """{mangled: readable} through c++filt when there is one; the name up to its parameters."""
    names = sorted(set(names))
    plain = {n: n for n in names}
    if not names or shutil.which("c++filt") is None:
        return plain
    r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    if r.returncode != 0:
        return plain
    anon = "(anonymous namespace)"
    for n, d in zip(names, r.stdout.splitlines()):
        d = d.replace(anon, "{anon}")  # not the parameters' '('
        depth, cut = 0, len(d)
        for i, ch in enumerate(d):  # the first '(' outside template brackets
            if ch == "<":
                depth += 1
            elif ch == ">":
                depth -= 1
            elif ch == "(" and depth == 0 and i > 0:
                cut = i
                break
        plain[n] = d[:cut].replace("{anon}", anon)
    return plain


def is_instruction(s):
    return bool(s) and not (s.startswith("//") or s.startswith(".") or s.endswith(":")
                            or s in ("{", "}") or s.startswith("$") or s.startswith(")")
                            or s.startswith("("))


def kernels(lines):
    """[(name, [(file, line, function label or None)] per instruction)] of every entry."""
    out, cur, where = [], None, (None, None, None)
    body = False
    for line in lines:
        m = ENTRY.match(line)
        if m:
            cur = (m.group(1), [])
            out.append(cur)
            where, body = (None, None, None), False
            continue
        if cur is None:
            continue
        s = line.strip()
        if s == "{" and not body:
            body = True
            continue
        if not body:
            continue
        if line.startswith("}"):
            cur, body = None, False
            continue
        m = LOC.search(s)
        if s.startswith(".loc") and m:
            where = (int(m.group(1)), int(m.group(2)), m.group(3))
            continue
        if is_instruction(s):
            cur[1].append(where)
    return out


def cubin_texts(path):
    """[(kernel, bytes)] of the `.text.<kernel>` sections of an ELF64 little-endian file."""
    with open(path, "rb") as f:
        elf = f.read()
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)

    def section(i):  # (name offset, file offset, size)
        name, _, _, _, off, size = struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize)
        return name, off, size

    strtab = section(shstrndx)[1]
    out = []
    for i in range(shnum):
        name_off, _, size = section(i)
        end = elf.index(b"\0", strtab + name_off)
        name = elf[strtab + name_off:end].decode("ascii", "replace")
        if name.startswith(".text.") and size > 0:
            out.append((name[len(".text."):], size))
    return out


def legacy_header(elf):
    """The cubin with its ELF header in the form before CUDA 12.8 (OS ABI 0x33, ABI version 7,
    e_flags = SM | 0x500 | SM << 16, SM from bits 8-15 of the newer e_flags), which older
    nvdisasm reads; an older cubin is returned as it is."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    if elf[8] < 8:
        return elf
    sm = (struct.unpack_from("<I", elf, 48)[0] >> 8) & 0xFF
    out = bytearray(elf)
    out[7], out[8] = 0x33, 7
    struct.pack_into("<I", out, 48, sm | 0x500 | sm << 16)
    return bytes(out)


SECTION = re.compile(r"^//-+ \.text\.(\S+) -+$")
SASS = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_.]*)")


def sass_kernels(text):
    """({kernel: [(opcode with modifiers, line)]}, {kernel: instructions not printed}) of
    `nvdisasm -c` output. An nvdisasm older than the cubin leaves out the instructions it cannot
    decode: the 16-byte slots missing between two printed addresses."""
    out, skipped, name, last = {}, {}, None, None
    for line in text.splitlines():
        m = SECTION.match(line.strip())
        if m:
            name, last = m.group(1), None
            out.setdefault(name, [])
            skipped.setdefault(name, 0)
            continue
        m = SASS.match(line)
        if m and name is not None:
            addr = int(m.group(1), 16)
            if last is not None and addr > last + 16:
                skipped[name] += (addr - last) // 16 - 1
            last = addr
            out[name].append((m.group(2), line.strip()))
    return out, skipped


def nvdisasm():
    for cand in (os.environ.get("NVDISASM"), shutil.which("nvdisasm"),
                 "/usr/local/cuda/bin/nvdisasm"):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def disassemble(path):
    """`nvdisasm -c` of the cubin, retried on a legacy-header copy when this nvdisasm predates
    the cubin's header."""
    tool = nvdisasm()
    if tool is None:
        raise OSError("no nvdisasm: set NVDISASM, or put the CUDA toolkit's bin on PATH")
    r = subprocess.run([tool, "-c", path], capture_output=True, text=True, check=False)
    if r.returncode == 0:
        return r.stdout
    with open(path, "rb") as f:
        elf = f.read()
    with tempfile.NamedTemporaryFile(suffix=".cubin") as tmp:
        tmp.write(legacy_header(elf))
        tmp.flush()
        r2 = subprocess.run([tool, "-c", tmp.name], capture_output=True, text=True, check=False)
    if r2.returncode != 0:
        raise OSError(f"{path}: nvdisasm failed: {(r.stderr or r2.stderr).strip()}")
    return r2.stdout


def selected(pattern, names, kernel):
    """Whether --kernel's pattern matches the kernel's mangled or readable name."""
    return bool(pattern.search(kernel) or pattern.search(names.get(kernel, kernel)))


def main_cubin(paths, kernel, sass=False, top=15, listing=False):
    pattern = re.compile(kernel)
    try:
        per = [(p, cubin_texts(p)) for p in paths]
        code = {p: sass_kernels(disassemble(p)) for p in paths} if sass else {}  # (ops, skipped)
    except (OSError, ValueError, struct.error) as e:
        print(f"ptx_size.py: {e}", file=sys.stderr)
        return 2
    names = demangle([k for _, ks in per for k, _ in ks])
    shown = 0
    for path, ks in per:
        for k, size in sorted(ks, key=lambda ks_: names.get(ks_[0], ks_[0])):
            if not selected(pattern, names, k):
                continue
            print(f"{size:8d} B  {names.get(k, k)}  ({path.split('/')[-1]})")
            shown += 1
            if not sass:
                continue
            instrs = code[path][0].get(k, [])
            missing = code[path][1].get(k, 0)
            ops = Counter(op for op, _ in instrs)
            note = f" (+{missing} this nvdisasm did not decode)" if missing else ""
            print(f"    {len(instrs)} SASS instructions{note}; most frequent opcodes:")
            for op, n in ops.most_common(top):
                print(f"      {n:6d} {op}")
            if listing:
                for _, line in instrs:
                    print(f"      {line}")
    if shown == 0:
        print(f"no kernel matches {kernel!r}", file=sys.stderr)
        return 1
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="one PTX file, or cubins with --cubin")
    ap.add_argument("--kernel", default="", help="regex on the mangled or demangled name")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--cubin", action="store_true", help="the files are cubins: SASS bytes")
    ap.add_argument("--sass", action="store_true",
                    help="with --cubin: SASS instructions per opcode (nvdisasm)")
    ap.add_argument("--listing", action="store_true", help="with --sass: the disassembly too")
    args = ap.parse_args(argv)
    if (args.sass or args.listing) and not args.cubin:
        ap.error("--sass and --listing need --cubin")
    if args.cubin:
        return main_cubin(args.files, args.kernel, args.sass or args.listing, args.top,
                          args.listing)
    if len(args.files) != 1:
        ap.error("one PTX file (several only with --cubin)")
    with open(args.files[0]) as f:
        lines = f.read().split("\n")
    files = {int(m.group(1)): m.group(2) for m in map(FILE.match, lines) if m}
    infos = info_strings(lines)
    ks = kernels(lines)
    names = demangle([k for k, _ in ks] + list(infos.values()))
    pattern = re.compile(args.kernel)
    shown = 0
    for kernel, instrs in ks:
        if not selected(pattern, names, kernel):
            continue
        shown += 1
        total = len(instrs)
        print(f"== {names.get(kernel, kernel)} ({kernel}): {total} PTX instructions")
        if total == 0:
            continue
        by_fn = Counter(names.get(infos.get(fn), infos.get(fn)) if fn else "(the kernel)"
                        for _, _, fn in instrs)
        by_line = Counter(f"{files.get(f, '?').split('/')[-1]}:{ln}" if f else "?"
                          for f, ln, _ in instrs)
        print("  by function:")
        for fn, n in by_fn.most_common(args.top):
            print(f"    {n:6d} {100.0 * n / total:5.1f} %  {fn}")
        print("  by source line:")
        for ln, n in by_line.most_common(args.top):
            print(f"    {n:6d} {100.0 * n / total:5.1f} %  {ln}")
    if shown == 0:
        print(f"no kernel matches {args.kernel!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
