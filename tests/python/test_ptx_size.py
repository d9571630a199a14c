"""bench/ptx_size.py (docs/perf.md §5 item 36): a kernel's PTX instructions counted per inlined
function and per source line, from the `.loc` before each instruction."""

import os
import struct
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "ptx_size.py")


def b8(s):
    return ".b8 " + ",".join(str(c) for c in s.encode()) + ",0"


# Two kernels; the first has 3 instructions of its own (lines 10, 11), 2 of `_Z4helpv` inlined
# (b.cuh:5) and a label, directives and comments that are not instructions.
PTX = "\n".join([
    "//",
    ".version 8.8",
    ".visible .entry _Z3fooPi(",
    "\t.param .u64 _Z3fooPi_param_0",
    ")",
    "{",
    "\t.reg .b32 \t%r<4>;",
    "\t.loc\t1 10 0",
    "\tld.param.u64 \t%rd1, [_Z3fooPi_param_0];",
    "\tmov.u32 \t%r1, %tid.x;",
    "\t.loc\t2 5 3, function_name $L__info_string0, inlined_at 1 11 2",
    "\tadd.s32 \t%r2, %r1, 1;",
    "$L__BB0_1:",
    "\t// a comment",
    "\t@%p1 bra \t$L__BB0_1;",
    "\t.loc\t1 11 0",
    "\tret;",
    "",
    "}",
    ".entry _Z3barv(",
    ")",
    "{",
    "\t.loc\t1 20 0",
    "\tret;",
    "",
    "}",
    "\t.file\t1 \"/src/a.cu\"",
    "\t.file\t2 \"/src/b.cuh\"",
    "\t.section\t.debug_str",
    "\t{",
    "$L__info_string0:",
    b8("_Z4helpv"),
    "\t}",
])


def run(tmp_path, *args):
    p = tmp_path / "k.ptx"
    p.write_text(PTX)
    return subprocess.run([sys.executable, SCRIPT, str(p)] + list(args), capture_output=True,
                          text=True, timeout=60)


def test_counts_by_function_and_line(tmp_path):
    r = run(tmp_path, "--kernel", "foo")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "_Z3fooPi): 5 PTX instructions" in out
    assert "_Z3barv" not in out
    fn = out.split("by function:")[1].split("by source line:")[0]
    rows = {line.split("%", 1)[1].strip(): int(line.split()[0])
            for line in fn.strip().splitlines()}
    assert rows["(the kernel)"] == 3
    helper = [k for k in rows if "help" in k]
    assert len(helper) == 1 and rows[helper[0]] == 2
    lines = out.split("by source line:")[1]
    got = {line.split("%", 1)[1].strip(): int(line.split()[0])
           for line in lines.strip().splitlines()}
    assert got == {"a.cu:10": 2, "b.cuh:5": 2, "a.cu:11": 1}


def test_every_kernel_and_no_match(tmp_path):
    r = run(tmp_path)
    assert r.returncode == 0, r.stderr
    assert "_Z3fooPi): 5 PTX" in r.stdout and "_Z3barv): 1 PTX" in r.stdout
    r = run(tmp_path, "--kernel", "nothing")
    assert r.returncode == 1 and "no kernel matches" in r.stderr


def elf(sections):
    """A minimal ELF64 little-endian file whose section headers name `sections` [(name, size)]
    (sizes only: no data), after a null section and before the section-name table."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n, _ in sections) + b".shstrtab\0"
    shoff = 64 + len(names)
    head = bytearray(64)
    head[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", head, 0x28, shoff)
    struct.pack_into("<HHH", head, 0x3A, 64, len(sections) + 2, len(sections) + 1)
    shdrs = bytearray(64)  # the null section
    pos = 1
    for n, size in sections:
        shdrs += struct.pack("<IIQQQQ", pos, 1, 6, 0, 0, size) + bytes(24)
        pos += len(n) + 1
    shdrs += struct.pack("<IIQQQQ", pos, 3, 0, 0, 64, len(names)) + bytes(24)
    return bytes(head) + names + bytes(shdrs)


def test_cubin_text_sizes(tmp_path):
    p = tmp_path / "k.cubin"
    p.write_bytes(elf([(".text._Z3fooPi", 1536), (".nv.info._Z3fooPi", 40),
                       (".text._Z3barv", 256), (".text._Z3emptyv", 0)]))
    r = subprocess.run([sys.executable, SCRIPT, "--cubin", str(p)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.strip().splitlines()]
    assert [(x[0], x[1]) for x in rows] == [("256", "B"), ("1536", "B")]  # by name
    assert "foo" in r.stdout and "bar" in r.stdout and "empty" not in r.stdout
    r = subprocess.run([sys.executable, SCRIPT, "--cubin", str(p), "--kernel", "bar"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.count(" B ") == 1 and "bar" in r.stdout
    bad = tmp_path / "x.cubin"
    bad.write_bytes(b"not an elf")
    r = subprocess.run([sys.executable, SCRIPT, "--cubin", str(bad)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "not a 64-bit little-endian ELF" in r.stderr


def load_script():
    import importlib.util
    spec = importlib.util.spec_from_file_location("ptx_size", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_legacy_header():
    mod = load_script()
    new = bytearray(elf([(".text._Z3fooPi", 64)]))
    new[7], new[8] = 0x41, 8  # the header CUDA 12.8+ writes: ABI version 8, SM in bits 8-15
    struct.pack_into("<I", new, 48, 0x06005A04)
    old = mod.legacy_header(bytes(new))
    assert old[7] == 0x33 and old[8] == 7
    assert struct.unpack_from("<I", old, 48)[0] == 0x5A055A  # SM 90, virtual SM 90
    assert old[:7] == bytes(new[:7]) and old[9:48] == bytes(new[9:48]) and old[52:] == new[52:]
    older = bytes(old)
    assert mod.legacy_header(older) == older  # already the older form
    try:
        mod.legacy_header(b"not an elf at all")
        raise AssertionError("accepted a non-ELF file")
    except ValueError:
        pass


# What `nvdisasm -c` prints (abridged): a section banner per kernel, then numbered instructions,
# some predicated, with labels and directives between them.
LISTING = "\n".join([
    "\t.headerflags\t@\"EF_CUDA_SM90\"",
    "//--------------------- .text._Z3fooPi --------------------------",
    "\t.section\t.text._Z3fooPi,\"ax\",@progbits",
    "_Z3fooPi:",
    "        /*0000*/                   LDC R1, c[0x0][0x28] ;",
    "        /*0010*/              @!P0 LDG.E.STRONG.SYS R3, [R2.64] ;",
    "        /*0020*/                   CCTL.IVALL ;",
    ".L_x_0:",
    "        /*0030*/               @P0 LDG.E.STRONG.SYS R3, [R2.64] ;",
    "        /*0040*/              @!UP0 BRA `(.L_x_0) ;",
    "        /*0060*/                   EXIT ;",  # 0x0050: an instruction it did not decode
    "//--------------------- .text._Z3barv --------------------------",
    "        /*0000*/                   EXIT ;",
])


def test_sass_opcodes_through_a_legacy_header(tmp_path):
    cubin = bytearray(elf([(".text._Z3fooPi", 96), (".text._Z3barv", 16)]))
    cubin[8] = 8
    struct.pack_into("<I", cubin, 48, 0x06005A04)
    p = tmp_path / "k.cubin"
    p.write_bytes(bytes(cubin))
    listing = tmp_path / "listing.txt"
    listing.write_text(LISTING)
    calls = tmp_path / "calls"
    # An nvdisasm that, like an older one, refuses the newer header and reads the older one.
    fake = tmp_path / "nvdisasm"
    fake.write_text("\n".join([
        f"#!{sys.executable}",
        "import sys",
        f"open({str(calls)!r}, 'a').write('x')",
        "elf = open(sys.argv[-1], 'rb').read()",
        "if elf[8] != 7:",
        "    sys.exit('nvdisasm fatal : Elf file does not contain Cuda architecture information')",
        f"sys.stdout.write(open({str(listing)!r}).read())",
    ]))
    fake.chmod(0o755)
    env = dict(os.environ, NVDISASM=str(fake))
    r = subprocess.run([sys.executable, SCRIPT, "--cubin", str(p), "--sass", "--kernel", "foo"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert calls.read_text() == "xx"  # refused once, then read from the rewritten copy
    assert "96 B" in r.stdout and "bar" not in r.stdout
    assert "6 SASS instructions (+1 this nvdisasm did not decode)" in r.stdout
    ops = r.stdout.split("most frequent opcodes:")[1]
    counts = {line.split()[1]: int(line.split()[0]) for line in ops.strip().splitlines()}
    assert counts == {"LDG.E.STRONG.SYS": 2, "LDC": 1, "CCTL.IVALL": 1, "BRA": 1, "EXIT": 1}
    r = subprocess.run([sys.executable, SCRIPT, "--cubin", str(p), "--listing", "--kernel",
                        "bar"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert "1 SASS instructions;" in r.stdout and "/*0000*/" in r.stdout
    r = subprocess.run([sys.executable, SCRIPT, str(p), "--sass"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--sass and --listing need --cubin" in r.stderr
