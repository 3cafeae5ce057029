#!/usr/bin/env bash
# Prepare a same-run A/B for `make gpu-check` (AB=1): write COMMIT's moelora/ and benchmarks/ into .ab_base/
# (ignored by git; name it in the device call's `carry`). The device machine gets no .git, so the "before"
# side has to travel as files.   usage: bash scripts/ab_base.sh COMMIT
set -euo pipefail
cd "$(dirname "$0")/.."
commit="${1:?usage: scripts/ab_base.sh COMMIT}"
rm -rf .ab_base
mkdir -p .ab_base
git archive "$commit" moelora benchmarks | tar -x -C .ab_base
git rev-parse --short "$commit" > .ab_base/COMMIT
echo "wrote .ab_base/ at $(cat .ab_base/COMMIT) ($(du -sh .ab_base | cut -f1)); carry it: carry=[\".ab_base\"]"
