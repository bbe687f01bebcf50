#!/usr/bin/env bash
# Make the git-ignored folder .te/ that scripts/gpu_te_setup.sh installs Transformer Engine from (issue 16),
# on a machine with network to PyPI; the GPU machines have none. Exact files are pinned: each is checked
# against scripts/te_files.sha256, and the run fails on any difference.
#
#   scripts/te_fetch.sh                   # download, split, verify
#   scripts/te_fetch.sh --write-manifest  # the same, then rewrite the manifest from what was downloaded
#                                         # (only when changing a pin; review the diff)
#
# .te/orig/   the downloaded files as published (stays here; never carried)
# .te/parts/  the cu13 wheel in 53 MiB parts: one device call carries at most 64 MiB with the repo's tree
# .te/small/  everything else, carried whole in one call
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TE_DIR="${TE_DIR:-$repo/.te}"
manifest="$repo/scripts/te_files.sha256"
write=0
[ "${1:-}" = --write-manifest ] && write=1
PART_SIZE=53M

big=transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
# The sdist has no wheel; `pip download` of it would run its build, which needs torch, so it comes by its
# PyPI address, pinned by sha256 below.
sdist=transformer_engine_torch-2.20.2.tar.gz
sdist_url=https://files.pythonhosted.org/packages/3d/fb/c9ce298a38c22ed1059923a01cac7e1f4e4f7281d39a8679c8118febe079/$sdist
# Runtime needs of transformer_engine.pytorch that the device image's package list does not name
# (docs/te_setup.md): pydantic at import, nvdlfw-inspect for TE's debug API. pydantic 2.12 rather than the
# newest, whose typing-extensions>=4.16 would replace the image's copy.
deps=(
    transformer-engine==2.20.2 transformer-engine-cu13==2.20.2
    pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.7.0 typing-inspection==0.4.2
    typing-extensions==4.15.0 nvdlfw-inspect==0.2.2
)

mkdir -p "$TE_DIR/orig" "$TE_DIR/parts" "$TE_DIR/small"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$TE_DIR/orig" "${deps[@]}"
[ -f "$TE_DIR/orig/$sdist" ] || curl -sSfL -o "$TE_DIR/orig/$sdist" "$sdist_url"

rm -f "$TE_DIR/parts/$big".part-*
split -b "$PART_SIZE" -d -a 2 "$TE_DIR/orig/$big" "$TE_DIR/parts/$big.part-"
for f in "$TE_DIR"/orig/*; do
    [ "$(basename "$f")" = "$big" ] || cp -p "$f" "$TE_DIR/small/"
done

if [ "$write" = 1 ]; then
    {
        echo "# sha256 of what scripts/gpu_te_setup.sh installs Transformer Engine from; paths relative to .te/"
        echo "# (made by scripts/te_fetch.sh --write-manifest). joined/X is X once its parts/X.part-NN are"
        echo "# concatenated in order; it is the file as published on PyPI."
        cd "$TE_DIR"
        cp -p "orig/$big" "joined.tmp" && mkdir -p joined && mv joined.tmp "joined/$big"
        sha256sum "joined/$big" parts/* small/*
    } >"$manifest.new"
    mv "$manifest.new" "$manifest"
    rm -f "$TE_DIR/joined/$big"
fi

# Verify what was made against the manifest, the same way the GPU machine will (no install).
TE_DIR="$TE_DIR" TE_STASH= "$repo/scripts/gpu_te_setup.sh" join
rm -rf "$TE_DIR/joined"
echo "te_fetch: sizes (MiB):"
(cd "$TE_DIR" && du -m parts/* small/* | sed 's/^/  /')
echo "te_fetch: small/ in all: $(du -cm "$TE_DIR"/small/* | tail -1 | cut -f1) MiB"
