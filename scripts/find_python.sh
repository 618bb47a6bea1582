#!/usr/bin/env bash
# Print the path of a working Python of version $1 (e.g. 3.12): `python$1` on PATH when it
# runs (a pyenv shim for a version that is not selected does not), else the newest one
# pyenv has installed. Exit 1 with one line when there is none.
set -u
v=$1
root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
for c in "$(command -v "python$v" 2>/dev/null)" \
         $(ls -d "$root"/versions/"$v".*/bin/"python$v" 2>/dev/null | sort -V -r); do
  if [ -n "$c" ] && "$c" -c "import sys; assert sys.version.startswith('$v.')" 2>/dev/null; then
    echo "$c"
    exit 0
  fi
done
echo "no working python$v found: install Python $v, or pass PYTHON=/path/to/python$v" >&2
exit 1
