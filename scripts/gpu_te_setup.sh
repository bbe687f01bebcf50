#!/usr/bin/env bash
# Bring Transformer Engine 2.20.2 onto an offline GPU machine (issue 16).
#
# The device machines have torch 2.11.0+cu130 and nvcc 13.0 but no network, and a device call carries at
# most 64 MiB, so the 276 MB transformer-engine-cu13 wheel travels as parts over several calls into the
# git-ignored folder .te/ (docs/te_setup.md has the call-by-call plan; scripts/te_fetch.sh makes the
# folder on a machine with network). Every file is checked against scripts/te_files.sha256 before use.
#
#   scripts/gpu_te_setup.sh collect   # calls 1..N-1: check the parts carried so far, keep a copy outside
#                                     # the repo, say which are still to come; never installs anything
#   scripts/gpu_te_setup.sh join      # join the parts and verify every file; installs nothing
#   scripts/gpu_te_setup.sh [all]     # join + verify, install the wheels, build (or install the prebuilt)
#                                     # transformer-engine-torch, copy the built wheel to $OUT, smoke test
#
# Environment (defaults are the device machine's): PYTHON (python3), CUDA_HOME (/usr/local/cuda),
# MAX_JOBS (16), TE_DIR (<repo>/.te), TE_MANIFEST (scripts/te_files.sha256), TE_STASH (/tmp/te_stash; empty: none),
# OUT (unset: nothing is copied out).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
mode="${1:-all}"
TE_DIR="${TE_DIR:-$repo/.te}"
TE_MANIFEST="${TE_MANIFEST:-$repo/scripts/te_files.sha256}"
# A copy of each verified part outside the repo: if a later call's sync ever drops ignored files that it
# was not told to carry, the parts of earlier calls still sit here while the machine stays warm. Set it
# empty to keep no copy (scripts/te_fetch.sh does, on the CPU machine).
TE_STASH="${TE_STASH-/tmp/te_stash}"
PYTHON="${PYTHON:-python3}"
TE_VERSION=2.20.2

say() { printf 'te_setup: %s\n' "$*"; }
# One line on stderr, naming what is wrong, then a non-zero exit: the reply's output tail shows it.
die() { printf 'te_setup: FAILED: %s\n' "$*" >&2; exit 1; }

[ -f "$TE_MANIFEST" ] || die "no manifest at $TE_MANIFEST"

# The manifest is sha256sum's format, paths relative to TE_DIR: parts/<file>.part-NN (pieces of a large
# file), joined/<file> (that file once its parts are concatenated, in part order) and small/<file>
# (carried whole).
declare -A want=()
order=()
while read -r sum path; do
    [ -z "${sum:-}" ] && continue
    case "$sum" in \#*) continue ;; esac
    want["$path"]="$sum"
    order+=("$path")
done <"$TE_MANIFEST"

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

# Where a manifest path is found: in TE_DIR, else (parts only) in the stash. Prints nothing if absent.
locate() {
    local rel="$1"
    if [ -f "$TE_DIR/$rel" ]; then
        printf '%s\n' "$TE_DIR/$rel"
    elif [[ "$rel" == parts/* ]] && [ -n "$TE_STASH" ] && [ -f "$TE_STASH/${rel#parts/}" ]; then
        printf '%s\n' "$TE_STASH/${rel#parts/}"
    fi
}

# Check every part and small file; a part that verifies is copied to the stash. Fills the arrays missing,
# corrupt and present. A corrupt copy in TE_DIR does not hide a good one in the stash.
check_pieces() {
    missing=() corrupt=() present=()
    local rel f got ok
    for rel in "${order[@]}"; do
        [[ "$rel" == joined/* ]] && continue
        ok=0 got=""
        local candidates=("$TE_DIR/$rel")
        [[ "$rel" == parts/* && -n "$TE_STASH" ]] && candidates+=("$TE_STASH/${rel#parts/}")
        for f in "${candidates[@]}"; do
            [ -f "$f" ] || continue
            got="$(sha_of "$f")"
            if [ "$got" = "${want[$rel]}" ]; then
                ok=1
                if [[ "$rel" == parts/* && -n "$TE_STASH" && "$f" == "$TE_DIR/"* ]]; then
                    mkdir -p "$TE_STASH"
                    cmp -s "$f" "$TE_STASH/${rel#parts/}" 2>/dev/null || cp "$f" "$TE_STASH/${rel#parts/}"
                fi
                break
            fi
        done
        if [ "$ok" = 1 ]; then
            present+=("$rel")
        elif [ -n "$got" ]; then
            corrupt+=("$rel")
        else
            missing+=("$rel")
        fi
    done
}

# Concatenate the parts of each joined/<file> in part order and check the result's sha256.
join_all() {
    local rel name parts p tmp
    for rel in "${order[@]}"; do
        [[ "$rel" == joined/* ]] || continue
        name="${rel#joined/}"
        if [ -f "$TE_DIR/$rel" ] && [ "$(sha_of "$TE_DIR/$rel")" = "${want[$rel]}" ]; then
            continue
        fi
        parts=()
        for p in "${order[@]}"; do
            [[ "$p" == "parts/$name.part-"* ]] && parts+=("$p")
        done
        [ "${#parts[@]}" -gt 0 ] || die "manifest names $rel but none of its parts (parts/$name.part-NN)"
        mkdir -p "$TE_DIR/joined"
        tmp="$TE_DIR/$rel.tmp"
        : >"$tmp"
        for p in $(printf '%s\n' "${parts[@]}" | sort); do
            cat "$(locate "$p")" >>"$tmp"
        done
        [ "$(sha_of "$tmp")" = "${want[$rel]}" ] || {
            rm -f "$tmp"
            die "joined $rel does not match its sha256 although every part did: the manifest is inconsistent"
        }
        mv "$tmp" "$TE_DIR/$rel"
        say "joined $rel from ${#parts[@]} parts, sha256 ok"
    done
}

check_pieces
case "$mode" in
collect)
    [ "${#corrupt[@]}" -eq 0 ] || die "corrupt (sha256 mismatch, carry again): ${corrupt[*]}"
    nparts=0 have=0
    for rel in "${order[@]}"; do [[ "$rel" == parts/* ]] && nparts=$((nparts + 1)); done
    for rel in "${present[@]}"; do [[ "$rel" == parts/* ]] && have=$((have + 1)); done
    say "have $have/$nparts parts (stash $TE_STASH); still to carry: ${missing[*]:-nothing}"
    exit 0
    ;;
join | all) ;;
*) die "unknown mode '$mode' (collect, join or all)" ;;
esac

if [ "${#missing[@]}" -gt 0 ] || [ "${#corrupt[@]}" -gt 0 ]; then
    die "missing: ${missing[*]:-none}; corrupt (sha256 mismatch): ${corrupt[*]:-none}; carry them again (docs/te_setup.md)"
fi
join_all
say "all ${#order[@]} manifest entries verified"
[ "$mode" = join ] && exit 0

# ---- install -------------------------------------------------------------------------------------------
pybin="$("$PYTHON" -c 'import os, sys; print(os.path.dirname(sys.executable))')"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
# torch's extension builder parallelises only through ninja, found on PATH: the venv's bin (where the ninja
# package puts it) is not on PATH when python3 is called by its full path. Without ninja the 33 sources
# compile one at a time, which does not fit a 10-minute call.
export PATH="$pybin:$CUDA_HOME/bin:$PATH"
command -v ninja >/dev/null || say "WARNING: no ninja on PATH: the build will be serial and slow"
pipi() { "$PYTHON" -m pip install --no-index --no-deps --no-cache-dir --disable-pip-version-check "$@"; }

# Runtime needs that the image may lack (pydantic and its family, nvdlfw-inspect): a carried wheel is
# installed only where its package is missing or older, so the image's own newer versions stay.
extra_list="$("$PYTHON" - "$TE_DIR/small" <<'EOF'
import pathlib, sys
from importlib import metadata
from packaging.version import Version
for whl in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name, ver = whl.name.split("-")[:2]
    if name.startswith("transformer_engine"):
        continue
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        have = None
    if have is None or Version(have) < Version(ver):
        print(whl)
EOF
)"
mapfile -t extra <<<"$extra_list"
[ -n "$extra_list" ] || extra=()
if [ "${#extra[@]}" -gt 0 ]; then
    say "installing ${#extra[@]} dependency wheels: ${extra[*]##*/}"
    pipi "${extra[@]}"
fi
core="$(ls "$TE_DIR"/joined/transformer_engine_cu13-"$TE_VERSION"-*.whl)"
meta="$(ls "$TE_DIR"/small/transformer_engine-"$TE_VERSION"-py3-none-any.whl)"
pipi "$meta" "$core"

# ---- transformer-engine-torch: the prebuilt wheel, else a build from the sdist ------------------------
torch_ver="$("$PYTHON" -c 'import torch; print(torch.__version__)')"
built="" fresh=0
for w in "$TE_DIR"/built/transformer_engine_torch-"$TE_VERSION"-*.whl; do
    [ -f "$w" ] || continue
    # The extension links against one torch build: reuse a wheel only for the torch it was built with.
    if [ -f "$w.torch" ] && [ "$(cat "$w.torch")" = "$torch_ver" ]; then
        built="$w"
    else
        say "ignoring $w: built for torch '$(cat "$w.torch" 2>/dev/null || echo unknown)', this is $torch_ver"
    fi
done
log="${OUT:-/tmp}/te_build.log"
if [ -n "$built" ]; then
    say "installing prebuilt $built (torch $torch_ver), no build"
else
    sdist="$TE_DIR/small/transformer_engine_torch-$TE_VERSION.tar.gz"
    # The sdist compiles only C++ (a CppExtension, no .cu files) with g++ against torch, TE's bundled
    # headers and the CUDA headers of the toolkit that nvcc belongs to: CUDA_HOME/include. Three kinds of
    # header it needs are not there: CUDA 13 moved CCCL (nv/target, which cuda_fp16.h includes) to
    # include/cccl, which nvcc adds by itself and g++ does not; cuDNN and NCCL are not part of the toolkit
    # and on these machines sit in torch's nvidia wheels. The sdist's build code adds the wheels' headers
    # only with NVTE_BUILD_USE_NVIDIA_WHEELS=1, and then instead of the toolkit's; g++ searches
    # CPLUS_INCLUDE_PATH after the -I directories, so the toolkit keeps priority and these fill in.
    inc="$("$PYTHON" - "$CUDA_HOME" <<'EOF'
import pathlib, sys
cuda = pathlib.Path(sys.argv[1])
dirs = [cuda / "include" / "cccl", cuda / "targets" / "x86_64-linux" / "include" / "cccl"]
try:
    import nvidia
    roots = [pathlib.Path(p) for p in nvidia.__path__]
except ImportError:
    roots = []
for root in roots:
    for sub in ("cudnn", "nccl", "cu13"):  # cu13: cuBLAS, NVRTC, NVTX, CCCL headers if the toolkit lacks any
        dirs.append(root / sub / "include")
dirs = [d for d in dirs if d.is_dir()]
print(":".join(map(str, dirs)))
# Fail before a long build if a header that the sources include is nowhere to be found.
for header in ("nv/target", "cudnn.h", "nccl.h", "cublasLt.h", "nvrtc.h", "nvtx3/nvToolsExt.h"):
    if not any((d / header).is_file() for d in [cuda / "include", *dirs]):
        print(f"te_setup: FAILED: no {header} under {cuda / 'include'} or {[str(d) for d in dirs]}",
              file=sys.stderr)
        raise SystemExit(1)
EOF
)" || exit 1
    export CPLUS_INCLUDE_PATH="$inc${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
    export NVTE_FRAMEWORK=pytorch
    export MAX_JOBS="${MAX_JOBS:-16}"
    # Its bdist_wheel first tries to download a prebuilt wheel from GitHub; there is no network here.
    export NVTE_PYTORCH_FORCE_BUILD=TRUE
    # The version must be exactly 2.20.2 (TE asserts torch-ext == core == meta at import); without this a
    # build inside a git checkout appends +<that checkout's commit>.
    export NVTE_NO_LOCAL_VERSION=1
    say "building transformer-engine-torch $TE_VERSION: torch $torch_ver, CUDA_HOME $CUDA_HOME, MAX_JOBS $MAX_JOBS"
    say "extra headers: ${inc:-none found}; log $log"
    mkdir -p "$TE_DIR/built"
    rm -f "$TE_DIR"/built/transformer_engine_torch-"$TE_VERSION"-*.whl{,.torch}
    start=$SECONDS
    set +e
    "$PYTHON" -m pip wheel --no-build-isolation --no-deps --no-index --no-cache-dir -v \
        -w "$TE_DIR/built" "$sdist" >"$log" 2>&1
    rc=$?
    set -e
    if [ "$rc" -ne 0 ]; then
        grep -E -m 20 'error|Error|fatal' "$log" >&2 || true
        tail -n 30 "$log" >&2
        die "building transformer-engine-torch failed (rc $rc); log $log"
    fi
    built="$(ls "$TE_DIR"/built/transformer_engine_torch-"$TE_VERSION"-*.whl)" fresh=1
    printf '%s\n' "$torch_ver" >"$built.torch"
    say "built $(basename "$built") ($(du -h "$built" | cut -f1)) in $((SECONDS - start)) s"
fi
pipi "$built"

# Bring the built wheel back, so that later sessions carry it instead of building: $OUT returns files of
# at most 16 MiB, so a larger wheel comes back in 15 MiB parts, with their sha256.
if [ -n "${OUT:-}" ] && [ "$fresh" = 1 ]; then
    name="$(basename "$built")"
    cp "$built.torch" "$OUT/"
    if [ "$(stat -c %s "$built")" -le $((15 * 1024 * 1024)) ]; then
        cp "$built" "$OUT/"
    else
        split -b 15M -d -a 2 "$built" "$OUT/$name.part-"
    fi
    {
        (cd "$TE_DIR/built" && sha256sum "$name")
        for f in "$OUT/$name".part-*; do
            if [ -f "$f" ]; then (cd "$OUT" && sha256sum "$(basename "$f")"); fi
        done
    } >"$TE_DIR/built/$name.sha256"
    cp "$TE_DIR/built/$name.sha256" "$OUT/"
    say "copied the built wheel to \$OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
fi

# ---- smoke test ----------------------------------------------------------------------------------------
# transformer_engine.pytorch has no __version__ of its own (AttributeError); the version is
# transformer_engine's. torch is imported first, as moectl always does: libtransformer_engine.so needs
# libnccl.so.2, which TE does not preload and torch does from its nvidia wheel. Imported first, TE failed on
# the CPU machine with "libnccl.so.2: cannot open shared object file" (no NCCL on the loader path there).
"$PYTHON" - <<'EOF'
import torch
import transformer_engine
import transformer_engine.pytorch as te
import transformer_engine_torch as tex

print("te_setup: smoke: transformer_engine", transformer_engine.__version__, "| torch", torch.__version__,
      "| cuDNN", tex.get_cudnn_version(), "| extension", tex.__file__)
if torch.cuda.is_available():
    print("te_setup: smoke:", torch.cuda.get_device_name(), "fp8", te.is_fp8_available(return_reason=True),
          "mxfp8", te.is_mxfp8_available(return_reason=True))
    layer = te.GroupedLinear(2, 64, 128, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(48, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x, [16, 32])
    y.float().square().sum().backward()
    torch.cuda.synchronize()
    print("te_setup: smoke: GroupedLinear forward/backward ok", tuple(y.shape), tuple(x.grad.shape))
else:
    print("te_setup: smoke: no CUDA device: import only")
EOF
say "done"
