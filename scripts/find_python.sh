#!/usr/bin/env bash
# Prints the interpreter of Python X.Y: the first of python X.Y on PATH, pyenv's versions/X.Y.*,
# /usr/local/bin and /usr/bin that runs and reports X.Y; exits 1 (saying so) when there is none.
#
#   scripts/find_python.sh 3.10
set -euo pipefail
v=${1:?usage: $0 X.Y}
for c in "$(command -v "python$v" || true)" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v".*/bin/python"$v" \
         /usr/local/bin/python"$v" /usr/bin/python"$v"; do
    if [ -x "$c" ] && [ "$("$c" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = "$v" ]; then
        echo "$c"
        exit 0
    fi
done
echo "no Python $v found (python$v on PATH, pyenv's versions/$v.*, /usr/local/bin, /usr/bin)" >&2
exit 1
