#!/usr/bin/env bash
# Print the path of a working Python 3.10 (spear-tts pulls fairseq 0.12.2, which fails on 3.11+).
# Candidates: python3.10 / python3 on PATH, then pyenv installs. A pyenv shim on PATH can exist
# without the version being active, so each candidate must actually run and report 3.10.
candidates=(python3.10)
if command -v pyenv >/dev/null 2>&1; then
  candidates+=("$(pyenv root)"/versions/3.10.*/bin/python)
fi
candidates+=("$HOME"/.pyenv/versions/3.10.*/bin/python /usr/bin/python3.10 /usr/local/bin/python3.10 python3)
for cand in "${candidates[@]}"; do
  if "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 10))' >/dev/null 2>&1; then
    command -v "$cand" 2>/dev/null || echo "$cand"
    exit 0
  fi
done
echo "error: no working Python 3.10 found (install it, e.g. 'pyenv install 3.10')" >&2
exit 1
