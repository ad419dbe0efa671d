#!/usr/bin/env bash
# CLI tests of `dsbatch mkmodel` and `dsbatch inspect` (TAP lines "ok - NAME" / "not ok - NAME").
#
# inspect must accept both golden folders (and split tp8pp2 as TP8 x PP2 at layer 4); mkmodel must
# write folders with exactly the golden structure, deterministically from the seed, quickly for the
# tiny preset, and refuse to overwrite; and every kind of damage a checkpoint can carry (issue #2:
# truncated shard, header length past the end, wrong dtype, wrong shape, missing tensor, index
# naming a missing shard, config missing a key) must end in exit status 1 with exactly one stderr
# line naming the file and the tensor or key, never a crash. Damaged copies are made with python3's
# json module only (no safetensors package), rewriting headers properly so each copy carries one
# fault. Runs from the repository root; $DSBATCH and $GOLDEN come from tests/run_tests.sh.
set -u
DSBATCH=${DSBATCH:-build/dsbatch}
GOLDEN=${GOLDEN:-../shared/golden}
TMP=$(mktemp -d "${TMPDIR:-/tmp}/dsbatch_mkinspect.XXXXXX")
trap '[ -n "${KEEP:-}" ] || rm -rf "$TMP"' EXIT

ok() { echo "ok - $1"; }
not_ok() {
  echo "not ok - $1"
  [ -n "${2:-}" ] && printf '%s\n' "$2" | head -20 | sed 's/^/#   /'
  return 0
}
# run NAME CMD...: ok when CMD exits 0; its output is kept in $TMP/out for later checks.
run() {
  local name=$1; shift
  if "$@" >"$TMP/out" 2>&1; then ok "$name"; else not_ok "$name" "$(cat "$TMP/out")"; fi
}
now() { date +%s.%N; }
elapsed_lt() { python3 -c "import sys; sys.exit(0 if float('$2') - float('$1') < float('$3') else 1)"; }

SHARD=model-00001-of-00001.safetensors

# ---------------------------------------------------------------- inspect on the golden folders
run "inspect golden small6" "$DSBATCH" inspect "$GOLDEN/small6"
run "inspect golden tp8pp2" "$DSBATCH" inspect "$GOLDEN/tp8pp2"
run "inspect golden tp8pp2 --tp 8 --pp 2" "$DSBATCH" inspect "$GOLDEN/tp8pp2" --tp 8 --pp 2
if grep -qE '^ +15 +1 +7 +4-7\+mtp ' "$TMP/out" && grep -qE '^ +0 +0 +0 +0-3 ' "$TMP/out"; then
  ok "tp8pp2 splits at layer 4 (stage 0: 0-3, stage 1: 4-7 + DSpark)"
else
  not_ok "tp8pp2 splits at layer 4 (stage 0: 0-3, stage 1: 4-7 + DSpark)" "$(cat "$TMP/out")"
fi

# ---------------------------------------------------------------- mkmodel tiny
t0=$(now)
run "mkmodel --preset tiny" "$DSBATCH" mkmodel --preset tiny --seed 1 --out "$TMP/tiny"
run "inspect the tiny model" "$DSBATCH" inspect "$TMP/tiny"
t1=$(now)
if elapsed_lt "$t0" "$t1" 10; then ok "mkmodel tiny + inspect in < 10 s"; else not_ok "mkmodel tiny + inspect in < 10 s" "took $t0 .. $t1"; fi

# Same tensors (names, dtypes, shapes, offsets), same index and same Engram constants as golden small6.
cat >"$TMP/same_layout.py" <<'EOF'
import json, struct, sys
def header(path):
    with open(path, 'rb') as f:
        n = struct.unpack('<Q', f.read(8))[0]
        h = json.loads(f.read(n))
    h.pop('__metadata__', None)
    return h
mine, gold, shard = sys.argv[1], sys.argv[2], sys.argv[3]
assert header(f'{mine}/{shard}') == header(f'{gold}/{shard}'), 'shard header differs'
assert json.load(open(f'{mine}/model.safetensors.index.json')) == json.load(open(f'{gold}/model.safetensors.index.json')), 'index differs'
assert header(f'{mine}/engram.safetensors') == header(f'{gold}/engram.safetensors'), 'engram header differs'
# The sidecar data (multipliers, offsets, primes, layer ids, token map) is fully determined.
a, b = open(f'{mine}/engram.safetensors', 'rb').read(), open(f'{gold}/engram.safetensors', 'rb').read()
na, nb = struct.unpack('<Q', a[:8])[0], struct.unpack('<Q', b[:8])[0]
assert a[8 + na:] == b[8 + nb:], 'engram constants differ'
cm, cg = json.load(open(f'{mine}/config.json'))['text_config'], json.load(open(f'{gold}/config.json'))['text_config']
for k, v in cg.items():
    if k != 'max_position_embeddings':
        assert cm.get(k) == v, f'config {k}: {cm.get(k)} != {v}'
assert cm['max_position_embeddings'] >= 8192, 'preset max_position_embeddings < 8192'
EOF
run "tiny has exactly the golden small6 layout" python3 "$TMP/same_layout.py" "$TMP/tiny" "$GOLDEN/small6" "$SHARD"

# ---------------------------------------------------------------- determinism
run "mkmodel tiny again, same seed, one thread" env OMP_NUM_THREADS=1 "$DSBATCH" mkmodel --preset tiny --seed 1 --out "$TMP/tiny_again"
same=1
for f in config.json "$SHARD" model.safetensors.index.json engram.safetensors; do
  cmp -s "$TMP/tiny/$f" "$TMP/tiny_again/$f" || same=0
done
if [ $same = 1 ]; then ok "same seed gives byte-identical files"; else not_ok "same seed gives byte-identical files"; fi
run "mkmodel tiny, seed 2" "$DSBATCH" mkmodel --preset tiny --seed 2 --out "$TMP/tiny_seed2"
if ! cmp -s "$TMP/tiny/$SHARD" "$TMP/tiny_seed2/$SHARD"; then ok "another seed gives other weights"; else not_ok "another seed gives other weights"; fi

# ---------------------------------------------------------------- tp8pp2 preset
run "mkmodel --preset tp8pp2" "$DSBATCH" mkmodel --preset tp8pp2 --seed 2 --out "$TMP/tp8pp2"
run "inspect the tp8pp2 model --tp 8 --pp 2" "$DSBATCH" inspect "$TMP/tp8pp2" --tp 8 --pp 2
run "tp8pp2 has exactly the golden tp8pp2 layout" python3 "$TMP/same_layout.py" "$TMP/tp8pp2" "$GOLDEN/tp8pp2" "$SHARD"

# ---------------------------------------------------------------- v41-flash slice (real dimensions)
# The real vocab (2 x 1.3 GB embed/head) and Engram tables (384 M rows, ~100 GB) are far too big for
# CI, so the slice shrinks the vocab and the Engram prime range; every other dimension stays real.
V41=(--preset v41-flash --layers 0-1 --experts 2 --vocab_size 8192 --dspark_noise_token_id 8191
     --engram_vocab_size 1000 --engram_compressed_vocab_size 4096 --seed 3)
"$DSBATCH" mkmodel "${V41[@]}" --out "$TMP/v41" --dry-run >"$TMP/out" 2>&1
bytes=$(sed -n 's/.* \([0-9]*\) bytes$/\1/p' "$TMP/out")
if [ -n "$bytes" ] && [ "$bytes" -lt 1500000000 ]; then
  ok "v41-flash slice is small enough for CI ($bytes bytes)"
  run "mkmodel --preset v41-flash --layers 0-1" "$DSBATCH" mkmodel "${V41[@]}" --out "$TMP/v41"
  run "inspect the v41-flash slice --tp 2 --pp 2" "$DSBATCH" inspect "$TMP/v41" --tp 2 --pp 2
  rm -rf "$TMP/v41"
else
  not_ok "v41-flash slice is small enough for CI" "$(cat "$TMP/out")"
fi

# ---------------------------------------------------------------- mkmodel refusals
# expect_error NAME PATTERN CMD...: exit status 1 (not a signal), one stderr line matching PATTERN.
expect_error() {
  local name=$1 pat=$2; shift 2
  "$@" >"$TMP/stdout" 2>"$TMP/stderr"; local rc=$?
  local lines; lines=$(wc -l <"$TMP/stderr")
  if [ $rc -eq 1 ] && [ "$lines" -eq 1 ] && grep -qE -- "$pat" "$TMP/stderr"; then
    ok "$name"
  else
    not_ok "$name" "exit $rc, $lines stderr lines, wanted /$pat/: $(cat "$TMP/stderr")"
  fi
}
before=$(ls -l "$TMP/tiny" | md5sum)
expect_error "mkmodel refuses an existing non-empty --out" "$TMP/tiny.*not empty" \
  "$DSBATCH" mkmodel --preset tiny --seed 5 --out "$TMP/tiny"
if [ "$(ls -l "$TMP/tiny" | md5sum)" = "$before" ] && ! ls -d "$TMP"/tiny.tmp-* >/dev/null 2>&1; then
  ok "the refused folder is untouched and no temporary folder is left"
else
  not_ok "the refused folder is untouched and no temporary folder is left"
fi
expect_error "mkmodel --layers refuses to cut a KV-sharing group" "cuts KV-sharing group 2-7" \
  "$DSBATCH" mkmodel --preset v41-flash --layers 3-4 --out "$TMP/cut"
expect_error "mkmodel rejects an unknown option" "hidden_sise" \
  "$DSBATCH" mkmodel --preset tiny --hidden_sise 512 --out "$TMP/typo"
run "mkmodel geometry overrides (--hidden_size 512 --num_hidden_layers 4 ...)" "$DSBATCH" mkmodel --preset tiny \
  --hidden_size 512 --num_hidden_layers 4 --compress_ratios '[0,2,2,1,0]' --index_source_layer_ids '[1,3]' \
  --dspark_target_layer_ids '[2,3]' --engram_vocab_size 200 --out "$TMP/over"
run "inspect the overridden model" "$DSBATCH" inspect "$TMP/over"

# ---------------------------------------------------------------- damaged copies (issue #2)
cat >"$TMP/st_edit.py" <<'EOF'
# st_edit.py DIR OP TENSOR [ARG]: rewrite DIR's shard header (and index) with one change.
#   dtype T NEW | shape T d0,d1 | drop T (removes the tensor's bytes and its index entry)
import json, struct, sys
d, op, name = sys.argv[1], sys.argv[2], sys.argv[3]
shard = f'{d}/model-00001-of-00001.safetensors'
raw = open(shard, 'rb').read()
n = struct.unpack('<Q', raw[:8])[0]
h = json.loads(raw[8:8 + n])
data = raw[8 + n:]
if op == 'dtype':
    h[name]['dtype'] = sys.argv[4]
elif op == 'shape':
    h[name]['shape'] = [int(x) for x in sys.argv[4].split(',')]
elif op == 'drop':
    lo, hi = h.pop(name)['data_offsets']
    data = data[:lo] + data[hi:]
    for k, v in h.items():
        if k != '__metadata__' and v['data_offsets'][0] >= hi:
            v['data_offsets'] = [v['data_offsets'][0] - (hi - lo), v['data_offsets'][1] - (hi - lo)]
    idx = json.load(open(f'{d}/model.safetensors.index.json'))
    del idx['weight_map'][name]
    idx['metadata']['total_size'] -= hi - lo
    json.dump(idx, open(f'{d}/model.safetensors.index.json', 'w'), indent=2)
text = json.dumps(h, separators=(',', ':')).encode()
text += b' ' * (-len(text) % 8)
open(shard, 'wb').write(struct.pack('<Q', len(text)) + text + data)
EOF
copy() {  # copy NAME: a fresh copy of golden small6 at $TMP/bad_NAME
  rm -rf "$TMP/bad_$1"; mkdir "$TMP/bad_$1"
  cp "$GOLDEN/small6/config.json" "$GOLDEN/small6/engram.safetensors" "$GOLDEN/small6/$SHARD" \
     "$GOLDEN/small6/model.safetensors.index.json" "$TMP/bad_$1/"
  echo "$TMP/bad_$1"
}

d=$(copy truncated); truncate -s $(( $(stat -c %s "$d/$SHARD") - 4096 )) "$d/$SHARD"
expect_error "damaged (a) truncated shard" "$d/$SHARD" "$DSBATCH" inspect "$d"

d=$(copy hdrlen); printf '\x00\x00\x00\x40\x00\x00\x00\x00' | dd of="$d/$SHARD" bs=1 count=8 conv=notrunc status=none
expect_error "damaged (b) header length beyond the file" "$d/$SHARD.*header length" "$DSBATCH" inspect "$d"

d=$(copy dtype); python3 "$TMP/st_edit.py" "$d" dtype layers.2.attn.q_norm.weight F16
expect_error "damaged (c) dtype changed in the header" "$d/$SHARD.*layers\.2\.attn\.q_norm\.weight" "$DSBATCH" inspect "$d"

d=$(copy dtype_size); python3 "$TMP/st_edit.py" "$d" dtype layers.2.attn.q_norm.weight F32
expect_error "damaged (c') dtype of another width" "$d/$SHARD.*layers\.2\.attn\.q_norm\.weight" "$DSBATCH" inspect "$d"

d=$(copy shape); python3 "$TMP/st_edit.py" "$d" shape layers.3.attn.wkv.weight 128,128
expect_error "damaged (d) shape changed" "$d/$SHARD.*layers\.3\.attn\.wkv\.weight" "$DSBATCH" inspect "$d"

d=$(copy missing); python3 "$TMP/st_edit.py" "$d" drop layers.4.ffn.experts.1.w3.scale
expect_error "damaged (e) missing tensor" "$d.*layers\.4\.ffn\.experts\.1\.w3\.scale" "$DSBATCH" inspect "$d"

d=$(copy noshard)
python3 - "$d" <<'EOF'
import json, sys
p = f'{sys.argv[1]}/model.safetensors.index.json'
idx = json.load(open(p))
idx['weight_map']['norm.weight'] = 'model-00002-of-00002.safetensors'
json.dump(idx, open(p, 'w'), indent=2)
EOF
expect_error "damaged (f) index names a missing shard" "model\.safetensors\.index\.json.*model-00002-of-00002" "$DSBATCH" inspect "$d"

d=$(copy nohidden)
python3 - "$d" <<'EOF'
import json, sys
p = f'{sys.argv[1]}/config.json'
c = json.load(open(p))
del c['text_config']['hidden_size']
json.dump(c, open(p, 'w'), indent=2)
EOF
expect_error "damaged (g) config.json missing hidden_size" "$d/config\.json.*hidden_size" "$DSBATCH" inspect "$d"

expect_error "inspect of a missing folder" "$TMP/nowhere" "$DSBATCH" inspect "$TMP/nowhere"
expect_error "inspect of a .h5 path that does not exist: one error line" "HDF5" "$DSBATCH" inspect "$TMP/out.h5"
expect_error "inspect --tp that does not divide the model" "not divisible by the tensor-parallel size 3" "$DSBATCH" inspect "$GOLDEN/small6" --tp 3
exit 0
