"""Where a kernel's spills sit: for each STL/LDL of nvdisasm's SASS, the loops (backward
branches) that enclose it, innermost first, as (head address, branch address).

  python spill_sites.py KERNEL.sass     (nvdisasm -c KERNEL.cubin > KERNEL.sass)
"""
import re, sys

lines = open(sys.argv[1]).read().splitlines()
labels, insts = {}, []
pending = []
for ln in lines:
  m = re.match(r"\s*(\.L_x_\d+):", ln)
  if m:
    pending.append(m.group(1)); continue
  m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*)", ln)
  if m:
    addr = int(m.group(1), 16)
    for lab in pending:
      labels[lab] = addr
    pending = []
    insts.append((addr, m.group(2)))
loops = []
for i, (addr, text) in enumerate(insts):
  m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", text)
  if not (m and m.group(1) in labels and labels[m.group(1)] <= addr):
    continue
  # Not loops: the return jump of an out-of-line slow path (an mbarrier try_wait's retry,
  # placed after the kernel's body: an unconditional BRA right after the retry's conditional
  # one), and spin loops of a few instructions (setmaxnreg's retry).
  if not text.startswith("@") and i and "BRA" in insts[i - 1][1]:
    continue
  if addr - labels[m.group(1)] <= 0x40:
    continue
  loops.append((labels[m.group(1)], addr))
for addr, text in insts:
  if re.search(r"\b(STL|LDL)", text):
    enc = sorted([l for l in loops if l[0] <= addr <= l[1]], key=lambda l: l[1] - l[0])
    print(f"{addr:#06x} {text.split(';')[0].strip():45s} loops: "
          + (", ".join(f"[{a:#x}..{b:#x}]" for a, b in enc[:3]) or "none"))
