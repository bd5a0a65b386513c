#!/usr/bin/env python3
"""Fails when a function (or lambda) declared in include/ takes more than 8 parameters: a kernel entry
point takes a parameter struct or views instead (docs/design.md). Usage: check_parameters.py [INCLUDE_DIR]."""
import glob
import os
import re
import sys

LIMIT = 8
KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "decltype", "static_assert", "alignas", "noexcept",
            "defined", "catch", "alignof", "throw"}


def strip(text):
    """The text without comments and string literals (kept the same length, so offsets give line numbers)."""
    out = re.sub(r"//[^\n]*", lambda m: " " * len(m.group(0)), text)
    out = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group(0)), out, flags=re.S)
    return re.sub(r'"(?:\\.|[^"\\\n])*"', lambda m: " " * len(m.group(0)), out)


def closing(text, start):
    depth = 1
    i = start
    while depth and i < len(text):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    return i


def count(inner):
    if not inner.strip() or inner.strip() == "void":
        return 0
    depth, n = 0, 1
    for c in inner:
        if c in "<([{":
            depth += 1
        elif c in ">)]}":
            depth -= 1
        elif c == "," and depth == 0:
            n += 1
    return n


def declarations(text):
    """(line, name, parameter count) of each function or lambda declared (defined) in text."""
    for m in re.finditer(r"(\b[A-Za-z_]\w*|\])\s*\(", text):
        name = m.group(1)
        if name in KEYWORDS:
            continue
        end = closing(text, m.end())
        inner = text[m.end():end - 1]
        after = text[end:end + 120]
        if name != "]":
            # A declaration: qualifiers, then a body, a semicolon or a constructor's initialisers; and the
            # token before the name is a type (not an operator: that is a call).
            if not re.match(r"\s*(const\s*)?(&\s*)?(noexcept(\([^)]*\))?\s*)?(override\s*)?(->[^{;]*)?(\{|;|:[^:])", after):
                continue
            if re.search(r"(=|return|\(|,|\?|:|\+|-|\*\s*\w+|&&|\|\||!)\s*$", text[max(0, m.start() - 40):m.start()]):
                continue
            parts = inner.split(",")
            if not all(len(p.split()) >= 2 or "..." in p for p in parts if p.strip()):
                continue  # arguments of a call, not parameters
        yield text.count("\n", 0, m.start()) + 1, name, count(inner)


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "include")
    files = sorted(glob.glob(os.path.join(root, "**", "*.hpp"), recursive=True) +
                   glob.glob(os.path.join(root, "**", "*.inc"), recursive=True))
    bad = []
    for path in files:
        with open(path) as f:
            text = strip(f.read())
        for line, name, n in declarations(text):
            if n > LIMIT:
                bad.append(f"{os.path.relpath(path, root)}:{line}: {'a lambda' if name == ']' else name} takes {n} "
                           f"parameters (at most {LIMIT}: pass a parameter struct or views)")
    for b in bad:
        print(b)
    print(f"check_parameters: {len(files)} headers, {len(bad)} functions over {LIMIT} parameters")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
