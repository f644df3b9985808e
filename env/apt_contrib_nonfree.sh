#!/usr/bin/env bash
# Enable Debian's contrib and non-free components (MBROLA is in contrib, its voices and SVOX Pico in non-free),
# in whichever sources format the machine uses. Idempotent; needs root. Used by .ci/run and the corpus recipe.
set -euo pipefail
deb822=/etc/apt/sources.list.d/debian.sources
if [ -f "$deb822" ]; then
  sed -i -E '/^Components:/{/non-free( |$)/!s/$/ non-free/;/contrib/!s/$/ contrib/}' "$deb822"
elif [ -f /etc/apt/sources.list ]; then
  sed -i -E '/^deb /{/non-free( |$)/!s/$/ non-free/;/contrib/!s/$/ contrib/}' /etc/apt/sources.list
else
  echo "no Debian apt sources found to add contrib and non-free to" >&2
  exit 1
fi
