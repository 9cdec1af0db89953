#!/usr/bin/env bash
# Stage what the GPU machine needs for the serving benchmark (benchmarks/run_issue25_device.sh). That
# machine is x86_64 with Python 3.12, reaches no package index and receives at most 64 MiB of files per
# command, so everything is fetched here, once, and packed small. Run from anywhere on a machine with
# network access (uses this checkout's .venv/bin/python when there is one):
#   bash benchmarks/stage_device.sh
# It writes, into .gpu/ (git-ignored):
#   triton-cache.tar.xz  $DEPLOYKIT_CACHE/triton/2.51.0 (default ~/.cache/deploykit) as
#                        deploykit/tools/triton_tools.py fetches it (tritonserver, its python backend,
#                        perf_analyzer), with the top folder 2.51.0/; setup untars it into
#                        $DEPLOYKIT_CACHE/triton. Only Python 3.12's python-backend stub is kept (the other
#                        python_backend_stubs/3.x and backends-3.x folders, and the libpython that only the
#                        3.13 stub links, are left out).
#   serve-site.tar.xz    a site-packages tree for CPython 3.12 manylinux x86_64 (unzipped wheels, no
#                        install): `deploykit serve`'s packages (fastapi, uvicorn, uvloop, httptools,
#                        prometheus-client and what they import) and tritonclient 2.51.0's Python package
#                        with its http/grpc needs, without its perf_analyzer/perf_client binaries (40 MB;
#                        the triton cache has perf_analyzer). setup untars it into /tmp/serve-site when
#                        that machine's Python lacks them. Versions: this venv's (pip freeze) where
#                        installed, else the newest; tritonclient is pinned to the server's 2.51.0.
#   test-tools.tar.xz    what `pytest tests/gpu` needs there and cannot fetch: headers/ (this machine's
#                        $DEPLOYKIT_CACHE/headers: ONNX Runtime's, TensorRT's and nlohmann/json's, fetched
#                        here with deploykit.native.build.fetch_headers() and json_headers(); the op library's
#                        and the C++ runtime's builds read them)
#                        and site/ (pytest-xdist and execnet, unzipped wheels: tests/gpu runs on several
#                        workers there), and bin/py-spy (a static binary, from its wheel: PROFILE_LEVEL and
#                        stacks of a server's processes there). setup untars it into $DEPLOYKIT_CACHE/headers,
#                        /tmp/test-site and /tmp/test-tools/bin, which run_issue25_device.sh puts on PATH.
#   ort0 .. ortN         onnxruntime-gpu, in parts of 55 MiB, by ../shared/gpu/stage-ort-gpu (cut again here).
# The calls that carry them (2026-12-05, a 5 MiB checkout): one per full part (a 59 MiB part with the checkout
# was refused as over 64 MiB), the last part with triton-cache.tar.xz (unpack it into $DEPLOYKIT_CACHE/triton
# there: setup then skips it), and serve-site.tar.xz with test-tools.tar.xz in the call that runs setup.
# serve-site's extension modules lose their debug info (binutils' strip; about 5 MiB of xz).
# Idempotent: an existing tarball (and the ort parts, by their version file) is reused; FORCE=1 remakes
# the two tarballs. The two tarballs together must stay under 50 MiB (they travel in one command with
# the checkout), else this fails.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
out=$root/.gpu
python=$root/.venv/bin/python
[ -x "$python" ] || python=python3
gpu_python=3.12
triton_version=2.51.0
tritonclient=tritonclient==$triton_version
cache=${DEPLOYKIT_CACHE:-$HOME/.cache/deploykit}
export DEPLOYKIT_CACHE=$cache
mkdir -p "$out"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

# ---------------------------------------------------------------- 1. triton-cache.tar.xz
if [ -f "$out/triton-cache.tar.xz" ] && [ "${FORCE:-0}" != 1 ]; then
  echo "reusing .gpu/triton-cache.tar.xz"
else
  # triton_tools fetches into $DEPLOYKIT_CACHE/triton/<version> on first use (a no-op when it is there)
  "$python" - "$triton_version" <<'PY'
import sys
from deploykit.tools import triton_tools
assert triton_tools.TRITON_VERSION == sys.argv[1], f"triton_tools fetches {triton_tools.TRITON_VERSION}, not {sys.argv[1]}"
print("triton tree:", triton_tools.fetch(verbose=True))
print("perf_analyzer:", triton_tools.perf_analyzer().command[0])
PY
  tree=$cache/triton/$triton_version
  server=pytriton/tritonserver
  [ -x "$tree/$server/python_backend_stubs/$gpu_python/triton_python_backend_stub" ] \
    || { echo "$tree has no Python $gpu_python stub" >&2; exit 1; }
  [ -d "$tree/$server/backends-$gpu_python/python" ] || { echo "$tree has no backends-$gpu_python" >&2; exit 1; }
  excludes=()
  for stub in "$tree/$server/python_backend_stubs"/*/; do
    version=$(basename "$stub")
    [ "$version" = "$gpu_python" ] && continue
    excludes+=(--exclude="$triton_version/$server/python_backend_stubs/$version"
               --exclude="$triton_version/$server/backends-$version")
  done
  # nvidia_pytriton.libs/libpython3-*.so: a bundled libpython (3.13's stub links it); the kept stub links
  # the machine's own libpython3.12.so, so it goes unless the kept stub asks for it
  if ! grep -q 'libpython3-' "$tree/$server/python_backend_stubs/$gpu_python/triton_python_backend_stub"; then
    excludes+=(--exclude="$triton_version/nvidia_pytriton.libs/libpython3-*")
  fi
  echo "packing $tree (xz -9: a few minutes)"
  tar -C "$cache/triton" --sort=name --owner=0 --group=0 --numeric-owner "${excludes[@]}" -cf - "$triton_version" \
    | xz -T0 -9 > "$tmp/triton-cache.tar.xz"
  mv "$tmp/triton-cache.tar.xz" "$out/triton-cache.tar.xz"
fi

# ---------------------------------------------------------------- 2. serve-site.tar.xz
# fastapi also needs annotated-doc and opentelemetry-api (its Requires-Dist since 0.16x)
serve_packages="fastapi starlette pydantic pydantic-core typing-extensions typing-inspection annotated-types
  annotated-doc opentelemetry-api anyio sniffio idna uvicorn uvloop httptools h11 click prometheus-client"
# tritonclient's http and grpc extras (packaging: tritonclient.grpc imports it; numpy, which it also
# needs, is the GPU machine's own, as torch's)
triton_packages="geventhttpclient gevent greenlet zope.event zope.interface brotli certifi urllib3
  python-rapidjson grpcio protobuf packaging"
if [ -f "$out/serve-site.tar.xz" ] && [ "${FORCE:-0}" != 1 ]; then
  echo "reusing .gpu/serve-site.tar.xz"
else
  # name==version as this venv has it, else the bare name (the newest)
  # shellcheck disable=SC2086
  mapfile -t requirements < <("$python" -m pip freeze --disable-pip-version-check 2> /dev/null \
    | "$python" -c '
import re, sys
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
installed = dict(line.strip().split("==", 1) for line in sys.stdin if "==" in line)
installed = {norm(name): version for name, version in installed.items()}
for name in sys.argv[1:]:
    print(f"{name}=={installed[norm(name)]}" if norm(name) in installed else name)
' $serve_packages $triton_packages)
  requirements+=("$tritonclient")
  mkdir -p "$tmp/wheels"
  platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
             --platform any)
  # newer manylinux tags, tried only for a package that has no wheel for the ones above (the GPU
  # machine's glibc is at least 2.35: tritonserver's wheel is manylinux_2_35)
  more=(--platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64)
  for requirement in "${requirements[@]}"; do
    download=(python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all:
              --python-version "$gpu_python" --implementation cp -d "$tmp/wheels" "${platforms[@]}")
    "${download[@]}" "$requirement" 2> "$tmp/pip.log" \
      || "${download[@]}" "${more[@]}" "$requirement" 2> "$tmp/pip.log" \
      || { grep -v 'is ignored' "$tmp/pip.log" >&2; echo "no CPython $gpu_python x86_64 wheel for $requirement" >&2; exit 1; }
    echo "  $requirement"
  done
  # Unzip every wheel into one tree: *.data/purelib and *.data/platlib at its root (where an install
  # puts them); *.data/scripts, headers and data (tritonclient's perf_analyzer and perf_client) left out.
  "$python" - "$tmp/wheels" "$tmp/site" <<'PY'
import shutil, sys, zipfile
from pathlib import Path
wheels, site = Path(sys.argv[1]), Path(sys.argv[2])
for wheel in sorted(wheels.glob("*.whl")):
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            name = info.filename
            if info.is_dir():
                continue
            top, _, rest = name.partition("/")
            if top.endswith(".data"):
                kind, _, rest = rest.partition("/")
                if kind not in ("purelib", "platlib"):
                    continue
                name = rest
            target = site / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as source, open(target, "wb") as sink:
                shutil.copyfileobj(source, sink)
            if (info.external_attr >> 16) & 0o111:
                target.chmod(0o755)
print(f"unzipped {len(list(wheels.glob('*.whl')))} wheels")
PY
  # Several extension modules ship with their debug info (uvloop's loop.so is 16 MB, 2 MB without it):
  # drop it, which changes no code (none of these wheels' modules were patched by auditwheel/patchelf).
  if command -v strip > /dev/null; then
    find "$tmp/site" -name '*.so' -type f -exec strip --strip-debug {} +
  else
    echo "no strip here: serve-site.tar.xz keeps the extension modules' debug info (about 5 MiB more)"
  fi
  (cd "$tmp/site" && ls -A) > "$tmp/top"
  mapfile -t top < "$tmp/top"
  tar -C "$tmp/site" --sort=name --owner=0 --group=0 --numeric-owner -cf - "${top[@]}" \
    | xz -T0 -9 > "$tmp/serve-site.tar.xz"
  mv "$tmp/serve-site.tar.xz" "$out/serve-site.tar.xz"
fi

# ---------------------------------------------------------------- 3. test-tools.tar.xz
if [ -f "$out/test-tools.tar.xz" ] && [ "${FORCE:-0}" != 1 ]; then
  echo "reusing .gpu/test-tools.tar.xz"
else
  # the op library's headers, and nlohmann/json's (the C++ runtime's build, tests/gpu/test_cpp_runtime_*)
  "$python" -c 'from deploykit.native import build; print(build.fetch_headers(verbose=True), build.json_headers(verbose=True))'
  mkdir -p "$tmp/tools/site" "$tmp/xdist-wheels"
  cp -r "$cache/headers" "$tmp/tools/headers"
  rm -f "$tmp"/tools/headers/*.lock
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d "$tmp/xdist-wheels" \
    pytest-xdist execnet
  for wheel in "$tmp"/xdist-wheels/*.whl; do "$python" -m zipfile -e "$wheel" "$tmp/tools/site"; done
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d "$tmp/py-spy-wheel" \
    --python-version "$gpu_python" --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 py-spy
  "$python" -m zipfile -e "$tmp"/py-spy-wheel/*.whl "$tmp/py-spy"
  mkdir -p "$tmp/tools/bin" && install -m 755 "$tmp"/py-spy/*.data/scripts/py-spy "$tmp/tools/bin/py-spy"
  tar -C "$tmp/tools" --sort=name --owner=0 --group=0 --numeric-owner -cf - bin headers site | xz -T0 -9 > "$out/test-tools.tar.xz"
fi

# ---------------------------------------------------------------- 4. onnxruntime-gpu parts
(cd "$root" && "$root/../shared/gpu/stage-ort-gpu")
# A device call carries 64 MiB with the checkout (about 5 MiB): stage-ort-gpu's 60 MiB parts leave no room for
# it, so they are cut again into 55 MiB parts (ort0 .. ortN, in order; its version file keeps them cached).
part_bytes=$(( 55 * 1024 * 1024 ))
if [ "$(stat -c %s "$out"/ort[0-9]*/part* | sort -n | tail -n 1)" -gt "$part_bytes" ]; then
  cat "$out"/ort[0-9]*/part* > "$tmp/ort.tar.xz"
  rm -rf "$out"/ort[0-9]*
  (cd "$tmp" && split -b "$part_bytes" -d ort.tar.xz part && i=0 \
    && for part in part*; do mkdir -p "$out/ort$i" && mv "$part" "$out/ort$i/"; i=$((i + 1)); done)
fi

# ---------------------------------------------------------------- checks and sizes
tar tJf "$out/triton-cache.tar.xz" > "$tmp/triton.list"
for member in bin/perf_analyzer lib/libb64.so.0d pytriton/tritonserver/bin/tritonserver \
              "pytriton/tritonserver/backends-$gpu_python/python/triton_python_backend_stub"; do
  grep -qx "$triton_version/$member" "$tmp/triton.list" || { echo "triton-cache.tar.xz lacks $triton_version/$member" >&2; exit 1; }
done
tar tJf "$out/serve-site.tar.xz" > "$tmp/site.list"
for member in fastapi/__init__.py uvicorn/__init__.py prometheus_client/__init__.py pydantic_core/__init__.py \
              tritonclient/http/__init__.py tritonclient/grpc/__init__.py geventhttpclient/__init__.py \
              packaging/version.py; do
  grep -qx "$member" "$tmp/site.list" || { echo "serve-site.tar.xz lacks $member" >&2; exit 1; }
done
if grep -q 'perf_analyzer\|perf_client' "$tmp/site.list"; then echo "serve-site.tar.xz has perf_analyzer" >&2; exit 1; fi
du -sh "$out"/*
bytes=$(( $(stat -c %s "$out/triton-cache.tar.xz") + $(stat -c %s "$out/serve-site.tar.xz") ))
echo "triton-cache.tar.xz + serve-site.tar.xz: $(( bytes / 1024 / 1024 )) MiB"
if [ "$bytes" -ge $(( 50 * 1024 * 1024 )) ]; then
  echo "the two tarballs are over 50 MiB: trim them" >&2; exit 1
fi
