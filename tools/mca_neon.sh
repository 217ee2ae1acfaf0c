#!/usr/bin/env bash
# Static throughput ESTIMATES (llvm-mca, not measurements) of the AArch64 NEON
# kernel's hot loops (csrc/kernel_f32_neon.c), as the table in
# docs/performance.md ("Arm64 NEON: llvm-mca estimates").
#
#   tools/mca_neon.sh                       # cross-compile, extract, simulate, print
#   ASM=/tmp/k.s tools/mca_neon.sh          # reuse an assembly file made with -g1 (below)
#   MCA=llvm-mca-16 CPUS="neoverse-n1 neoverse-v1" tools/mca_neon.sh
#   DUMP=/tmp/loops tools/mca_neon.sh       # also keep the extracted loop bodies there
#
# Needs: aarch64-linux-gnu-gcc (Debian: gcc-aarch64-linux-gnu), python3, and
# llvm-mca >= 16 (Debian 12: apt-get install llvm-19).  LLVM 14's llvm-mca has
# no Neoverse models: -mcpu=neoverse-n1/n2/v1 (and cortex-a76/x1 in every
# version) fall back to the Cortex-A57 model, which has one FP/ASIMD FMA pipe.
#
# How:
#  1. csrc/kernel_f32_neon.c is compiled with setup.py's flags (-O3 -std=c11
#     -fno-strict-aliasing) plus -g1, which adds line tables only: the
#     instructions are the same as with setup.py's -g0 (checked with gcc 12
#     by diffing the two outputs without directives).  About 70 s of one core.
#  2. Every loop (a label and a later conditional branch back to it) is listed
#     with the source lines of its .loc directives; a loop is assigned to a
#     kernel loop by a source line that only that loop has (found by text, so
#     edits above it do not break this) and by its fmla count (the register
#     block FA_BLK_MR x FA_BLK_NV, read from the unit, for the prefill micro-kernels).
#  3. The micro-kernels are inlined many times (one copy per call site and
#     constant); copies of one loop are grouped by (instructions, q-register
#     stack accesses) and the largest group is simulated, the others are
#     listed.  One extra row for comparison: a hand-written spill-free 6 x 4
#     Q.K^T step (a reference, not compiled code).
#  4. llvm-mca -iterations=$ITER on the loop body (branch included) per CPU:
#     cycles/iteration = Total Cycles / iterations.  FMA bound = (fmla + fmul)
#     / FMA-capable 128-bit pipes of the real core (N1 2, N2 2, V1 4, V2 4,
#     Apple M1 4), efficiency = bound / cycles.
#  Stores with base writeback are simulated as store + add (see unwb below).
#  llvm-mca assumes that loads never wait for earlier stores (-noalias): an
#  accumulator spilled to the stack in the loop (ldr / fmla / str on [sp]) is a
#  loop-carried chain it does not see.  For such loops the script also prints
#  the chain's lower bound from the model's own latencies (ldr q + fmla, no
#  store-forwarding delay), and efficiency against max(mca, chain).
set -euo pipefail

cd "$(dirname "$0")/.."
CC=${CC:-aarch64-linux-gnu-gcc}
ITER=${ITER:-200}
CPUS=${CPUS:-"neoverse-n1 neoverse-n2 neoverse-v1 neoverse-v2 apple-m1"}
if [ -z "${MCA:-}" ]; then
    for m in llvm-mca-19 llvm-mca-18 llvm-mca-17 llvm-mca-16; do
        if command -v "$m" >/dev/null; then MCA=$m; break; fi
    done
fi
if [ -z "${MCA:-}" ]; then
    echo "mca_neon.sh: no llvm-mca >= 16 found (apt-get install llvm-19), or set MCA=" >&2
    exit 1
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if [ -z "${ASM:-}" ]; then
    ASM=$WORK/k.s
    "$CC" -O3 -std=c11 -fno-strict-aliasing -g1 -Icsrc -S csrc/kernel_f32_neon.c -o "$ASM"
fi

echo "gcc: $("$CC" --version | head -1)"
echo "llvm-mca: $("$MCA" --version | grep -i 'llvm version' | sed 's/^ *//')"
echo "scheduling model per -mcpu (first resource names):"
printf 'fmla v0.4s, v1.4s, v2.4s\n' >"$WORK/probe.s"
for cpu in $CPUS; do
    res=$("$MCA" -mtriple=aarch64 -mcpu="$cpu" -iterations=1 "$WORK/probe.s" |
        awk '/^Resources:/{f=1;next} /^Resource pressure per/{f=0} f&&/^\[/{print $3}' |
        sed 's/Unit.*//' | sort -u | tr '\n' ' ')
    echo "  $cpu: $res"
done
echo

# ---- step 2-3: extract the loops (python) into $WORK/<name>.s + $WORK/loops.tsv
python3 - "$ASM" "$WORK" <<'EOF'
import collections, re, sys
asm, work = sys.argv[1], sys.argv[2]

def src_line(path, anchor, text):
    """1-based line of the first line containing text after the line containing anchor."""
    lines = open(path).read().split('\n')
    a = next(i for i, l in enumerate(lines) if anchor in l)
    return next(i for i in range(a, len(lines)) if text in lines[i]) + 1

U, I = 'csrc/kernel_ukernels.h', 'csrc/kernel_impl.h'
# name, description, (file, anchor, text) of a source line only that loop has, wanted fmla count, extra test
# the unit's register block (csrc/kernel_f32_neon.c): the prefill micro-kernels' fmla count
_unit = open('csrc/kernel_f32_neon.c').read()
MR = int(re.search(r'#define FA_BLK_MR (\d+)', _unit).group(1))
NV = int(re.search(r'#define FA_BLK_NV (\d+)', _unit).group(1))
KINDS = [
    ('qk_%dx%d' % (MR, NV), 'Q.K^T micro-kernel %dx%d (qk_ukernel)' % (MR, NV),
     (U, 'FA_NAME(qk_ukernel)(', 'vf_set1(Qp[d * mr + i])'), MR * NV, None),
    ('pv_%dx%d' % (MR, NV), 'P.V micro-kernel %dx%d (pv_ukernel)' % (MR, NV),
     (U, 'FA_NAME(pv_ukernel)(', 'vf_set1(P[i * ldp + j])'), MR * NV, None),
    ('exp_row', 'softmax exp2 (exp_row, vf_exp2_neg), 4 scores',
     (I, 'FA_NAME(exp_row)(', 'for (int64_t j = j0; j < j1; j += VW)'), 5, None),
    ('qk_rows1', 'decode Q.K^T, 1 row, f32 K, D=128 (qk_rows; 8 d per iter)',
     (U, '#pragma GCC unroll 1', 'for (int64_t d = 0; d < Dp2; d += 2 * VW)'), 2,
     lambda ins: any(re.match(r'cmp\s+x\d+, 512$', x) for x in ins)),          # Dp = 128 copy
    ('pv_rows1x8', 'decode P.V, 1 row x 8 vectors, D=128 (pv_rows_blk)',
     (U, 'FA_NAME(pv_rows_blk)(', 'for (int64_t j = 0; j < nj; j++)'), 8,
     lambda ins: sum(x.startswith(('ld1r', 'ldr\ts')) for x in ins) == 1),      # one P value
    ('pv_row1x16', 'decode P.V, 1 row x 16 vectors, D=64 (pv_row1)',
     (U, 'FA_NAME(pv_row1)(', 'vf pj = vf_set1(P[j])'), 16, None),
]
# a vector register stored to / loaded from the stack: a spilled accumulator
SPILL = re.compile(r'^(ldr|str|ldp|stp)\s+q\d+,.*\[sp\b')

def unwb(x):
    """A store with base writeback as the store plus an add (what the core's address
    micro-op does): llvm-mca makes the new base wait for the stored DATA, which
    serialised the exp loop (its next load's address waited for the whole exp2)."""
    m = re.match(r'^(st\w*)\s+(.*), \[(\w+)\], #?(-?\d+)$', x)        # post-index
    if m:
        return ['%s\t%s, [%s]' % (m.group(1), m.group(2), m.group(3)),
                'add\t%s, %s, %s' % (m.group(3), m.group(3), m.group(4))]
    m = re.match(r'^(st\w*)\s+(.*), \[(\w+), #?(-?\d+)\]!$', x)    # pre-index
    if m:
        return ['add\t%s, %s, %s' % (m.group(3), m.group(3), m.group(4)),
                '%s\t%s, [%s]' % (m.group(1), m.group(2), m.group(3))]
    return [x]

CVT = ('fcvtl', 'shll', 'sxtl', 'scvtf', 'ushll', 'sshll')   # 16/8-bit K or V copies: not float32

text = open(asm).read().split('\n')
files, labels, loops = {}, {}, []
BR = re.compile(r'^\s+(b\.?(?:ne|eq|lt|gt|le|ge|hi|ls|cc|cs|lo|hs|mi|pl)|cbn?z|tbn?z)\s+(.*)$')
for i, l in enumerate(text):
    m = re.match(r'^\s+\.file (\d+) (?:"[^"]*" )?"([^"]+)"', l)
    if m:
        files[m.group(1)] = m.group(2)
    m = re.match(r'^(\.L\d+):', l)
    if m:
        labels[m.group(1)] = i
    m = BR.match(l)
    if m:
        tgt = m.group(2).split(',')[-1].strip()
        if tgt in labels and i - labels[tgt] < 400:
            seg = text[labels[tgt] + 1:i + 1]
            ins = [x.strip() for x in seg if re.match(r'^\s+[a-z]', x)]
            locs = set()
            for x in seg:
                mm = re.match(r'^\s+\.loc (\d+) (\d+)', x)
                if mm:
                    locs.add((files.get(mm.group(1), '?').split('/')[-1], int(mm.group(2))))
            loops.append((tgt, ins, locs))

rows = []
for name, desc, (path, anchor, txt), nfma, extra in KINDS:
    key = (path.split('/')[-1], src_line(path, anchor, txt))
    cand = [(t, ins) for t, ins, locs in loops
            if key in locs and sum(x.startswith('fmla') for x in ins) == nfma
            and not any(x.startswith(CVT) for x in ins) and (extra is None or extra(ins))]
    if not cand:
        sys.exit('mca_neon.sh: no loop found for %s (source line %s:%d)' % (name, key[0], key[1]))
    # copies grouped by (instructions, stack accesses); keep the smallest loop of a label
    best = {}
    for t, ins in cand:
        if t not in best or len(ins) < len(best[t]):
            best[t] = ins
    groups = collections.defaultdict(list)
    for t, ins in best.items():
        groups[(len(ins), sum(bool(SPILL.match(x)) for x in ins))].append((t, ins))
    (n, nsp), members = max(groups.items(), key=lambda kv: (len(kv[1]), -kv[0][0]))
    body = [x2 for x in members[0][1] for x2 in unwb(x)]
    open('%s/%s.s' % (work, name), 'w').write('\n'.join(body) + '\n')
    others = ' '.join('%dx(%d instr, %d sp)' % (len(v), k[0], k[1])
                      for k, v in sorted(groups.items()) if k != (n, nsp))
    nf = sum(x.startswith(('fmla', 'fmul')) and '.4s' in x for x in body)
    rows.append('\t'.join(map(str, [name, desc, n, nf, nsp, len(members), others or '-',
                                   '%s:%d' % key])))
# Reference, not compiled code: the 6 x 4 Q.K^T step written by hand without spills (Q's 6 values
# as one ldr q + one ldr d, fmla by lane: 24 + 4 + 2 = 30 vector registers).
ref = ['ldp\tq24, q25, [x5]', 'ldp\tq26, q27, [x5, 32]', 'add\tx5, x5, 64',
       'ldr\tq28, [x4]', 'ldr\td29, [x4, 16]', 'add\tx4, x4, 24']
ref += ['fmla\tv%d.4s, v%d.4s, v%d.s[%d]' % (4 * i + v, 24 + v, 28 + i // 4, i % 4)
        for i in range(6) for v in range(4)]
ref += ['cmp\tx5, x6', 'b.ne\t.Lref']
open(work + '/qk_6x4_lane.s', 'w').write('\n'.join(ref) + '\n')
rows.append('\t'.join(['qk_6x4_lane', 'reference: hand-written 6x4 Q.K^T, ldr q + ldr d, fmla by lane',
                       str(len(ref)), '24', '0', '0', '-', '-']))
open(work + '/loops.tsv', 'w').write('\n'.join(rows) + '\n')
EOF

if [ -n "${DUMP:-}" ]; then mkdir -p "$DUMP" && cp "$WORK"/*.s "$WORK/loops.tsv" "$DUMP"/; fi

# ---- step 4: simulate each loop on each CPU
# 128-bit FMLA pipes of the real core (not of the model); other -mcpu names: 2
pipes() { case $1 in neoverse-v1|neoverse-v2|apple-m*|cortex-x*) echo 4 ;; *) echo 2 ;; esac; }
short() { case $1 in neoverse-n1) echo N1 ;; neoverse-n2) echo N2 ;; neoverse-v1) echo V1 ;;
    neoverse-v2) echo V2 ;; apple-m1) echo M1 ;; *) echo "$1" ;; esac; }
# model latency of one instruction (column 2 of -instruction-info)
lat() { printf '%s\n' "$2" >"$WORK/lat.s"
    "$MCA" -mtriple=aarch64 -mcpu="$1" -iterations=1 "$WORK/lat.s" |
        awk '/Instructions:$/{f=1;next} f&&NF>2{print $2; exit}'; }

hdr="| loop | instr/iter | FMAs/iter |"; sep="|---|---|---|"
for cpu in $CPUS; do hdr="$hdr $(short "$cpu") ($(pipes "$cpu") pipes) |"; sep="$sep---|"; done
echo "cycles/iteration (llvm-mca) / FMA-bound cycles = efficiency (ESTIMATES, not measurements)"
echo "$hdr"; echo "$sep"
notes=""
while IFS=$'\t' read -r name desc n nf nsp ncopies others src; do
    spill=""; if [ "$nsp" -gt 0 ]; then spill=", $nsp q-register stack accesses"; fi
    line="| $desc$spill | $n | $nf |"
    for cpu in $CPUS; do
        out=$("$MCA" -mtriple=aarch64 -mcpu="$cpu" -iterations="$ITER" "$WORK/$name.s")
        cyc=$(awk -v it="$ITER" '/^Total Cycles:/{printf "%.2f", $3/it}' <<<"$out")
        # busiest resource per iteration (resource pressure table: names, then one row of numbers)
        busy=$(awk '/^Resources:/{r=1;next} r&&/^\[/{nm[++k]=$3} /^Resource pressure per iteration:/{p=1;next}
                    p&&/^[ 0-9.-]+$/&&NF>1{for(i=1;i<=NF;i++) if($i!="-"&&$i+0>mx){mx=$i+0;b=nm[i]} p=0}
                    END{printf "%s %.2f", b, mx}' <<<"$out")
        bound=$(awk -v f="$nf" -v p="$(pipes "$cpu")" 'BEGIN{printf "%.2f", f/p}')
        eff=$cyc; chaintxt=""; le=""
        if [ "$nsp" -gt 0 ]; then   # spilled accumulator: ldr q + fmla per iteration, at least
            chain=$(( $(lat "$cpu" 'ldr q0, [sp, 16]') + $(lat "$cpu" 'fmla v0.4s, v1.4s, v2.4s') ))
            if awk -v a="$cyc" -v b="$chain" 'BEGIN{exit !(b > a)}'; then
                eff=$chain; chaintxt=" (chain >= $chain)"; le="<="
            fi
        fi
        pct=$(awk -v b="$bound" -v c="$eff" 'BEGIN{printf "%.0f", 100 * b / c}')
        line="$line $cyc$chaintxt / $bound = $le$pct% |"
        notes="$notes  $name $(short "$cpu"): busiest resource $busy cycles/iter"$'\n'
    done
    echo "$line"
    if [ "$src" = "-" ]; then
        notes="$notes  $name: written by hand (not compiled code), $n instructions"$'\n'
    else
        notes="$notes  $name: source line $src; simulated the $ncopies copies of $n instructions"
        notes="$notes with $nsp q-register stack accesses; other copies (instr, q stack accesses): $others"$'\n'
    fi
done <"$WORK/loops.tsv"
echo
echo "notes:"
printf '%s' "$notes"
