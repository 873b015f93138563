#!/usr/bin/env bash
# Create the peer engines' venvs for `python -m bench.peers`: bash bench/peers/setup.sh [vllm llamacpp ct2 ortgenai]
# (no argument: all four). Each goes in .cache/peers/venvs/<peer> (git-ignored) with
# bench/peers/requirements-<peer>.txt installed; .installed, written last, records the requirements'
# hash, so a second run with unchanged requirements does nothing.
# llama.cpp builds from source on one core (about 13 minutes; CMAKE_BUILD_PARALLEL_LEVEL=1 keeps the
# other core free), and its sdist's vendor/llama.cpp Python tools (the HF-to-GGUF converter) are
# extracted to .cache/peers/src/llama.cpp. vLLM's declared torchvision / torchaudio / torchcodec are
# removed afterwards: their wheels do not match its torch and it fails on torchvision::nms.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cache="$root/.cache/peers"
peers=("$@")
[ ${#peers[@]} -eq 0 ] && peers=(vllm llamacpp ct2 ortgenai)

llama_sdist() {  # the llama-cpp-python sdist named in the requirements, downloaded once
  local version
  version="$(sed -n 's/^llama-cpp-python==//p' "$here/requirements-llamacpp.txt")"
  mkdir -p "$cache/src"
  local sdist="$cache/src/llama_cpp_python-$version.tar.gz"
  [ -f "$sdist" ] || "$1" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$cache/src" >&2
  echo "$sdist"
}

for peer in "${peers[@]}"; do
  requirements="$here/requirements-$peer.txt"
  [ -f "$requirements" ] || { echo "unknown peer '$peer': no $requirements" >&2; exit 2; }
  venv="$cache/venvs/$peer"
  stamp="$(sha256sum "$requirements" | cut -d' ' -f1)"
  if [ "$(cat "$venv/.installed" 2>/dev/null)" = "$stamp" ]; then
    echo "$peer: up to date ($venv)"
    continue
  fi
  started=$SECONDS
  [ -x "$venv/bin/python" ] || { echo "$peer: creating $venv"; python3.11 -m venv "$venv"; }
  rm -f "$venv/.installed"
  if [ "$peer" = llamacpp ]; then
    sdist="$(llama_sdist "$venv/bin/python")"
    echo "$peer: installing (llama-cpp-python builds from $sdist on one core, about 13 minutes)"
    # --find-links: pip builds from the kept sdist, and keeps an installed build that matches the pin
    CMAKE_BUILD_PARALLEL_LEVEL=1 "$venv/bin/pip" install --find-links "$(dirname "$sdist")" -r "$requirements"
    rm -rf "$cache/src/llama.cpp"
    mkdir -p "$cache/src/llama.cpp"
    tar -xzf "$sdist" -C "$cache/src/llama.cpp" --strip-components=3 --wildcards \
      '*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/conversion/*' '*/vendor/llama.cpp/gguf-py/*'
    echo "$peer: llama.cpp's converter extracted to $cache/src/llama.cpp"
  else
    echo "$peer: installing $requirements"
    "$venv/bin/pip" install -r "$requirements"
  fi
  if [ "$peer" = vllm ]; then
    "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec
    echo "$peer: removed torchvision, torchaudio, torchcodec"
  fi
  echo "$stamp" > "$venv/.installed"
  echo "$peer: installed in $((SECONDS - started)) s ($(du -sh "$venv" | cut -f1))"
done
