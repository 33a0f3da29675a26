#!/usr/bin/env python3
"""Checks that the modules of a Rust crate depend on each other without cycles.

Usage: module-cycles.py <crate src dir>... [--graph]

Each `.rs` file is a module (`lib.rs`/`main.rs` the crate root, `x/mod.rs`
the module `x`). A module depends on another when it names it, or an item
in it, in a `use` or in a path (`crate::a::b`, `super::c`, a child `d::e`).
Declaring a child (`mod x;`) is not a dependency, and the crate root, which
declares and composes everything, is left out. Exits 1 and prints each cycle
found; `--graph` prints every edge too.
"""

import os
import re
import sys

USE = re.compile(r"\buse\s+([^;]+);", re.S)
PATH = re.compile(r"\b((?:crate|super|self)(?:::[A-Za-z_][A-Za-z0-9_]*)+)")
COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
STRING = re.compile(r'"(?:\\.|[^"\\])*"')


def modules(src):
    """Returns {module path tuple: file} for every .rs file under src."""
    found = {}
    for root, _, files in os.walk(src):
        for name in files:
            if not name.endswith(".rs"):
                continue
            path = os.path.join(root, name)
            parts = os.path.relpath(path, src)[:-3].split(os.sep)
            if parts[-1] == "mod":
                parts = parts[:-1]
            if parts in (["lib"], ["main"]):
                parts = []
            found[tuple(parts)] = path
    return found


def expand(tree):
    """Expands a use tree (`a::{b, c::{d}}`) into its paths."""
    tree = re.sub(r"\s+", "", tree)
    brace = tree.find("{")
    if brace < 0:
        return [tree.split(" as ")[0]]
    prefix, inner = tree[:brace], tree[brace + 1 : tree.rfind("}")]
    items, depth, current = [], 0, ""
    for char in inner:
        if char == "," and depth == 0:
            items.append(current)
            current = ""
            continue
        depth += char == "{"
        depth -= char == "}"
        current += char
    items.append(current)
    return [path for item in items if item for path in expand(prefix + item)]


def resolve(module, path, known):
    """Returns the deepest known module a path names, seen from `module`."""
    segments = [s for s in path.split("::") if s]
    if not segments:
        return None
    if segments[0] == "crate":
        base, rest = (), segments[1:]
    elif segments[0] == "super":
        base, rest = module, segments
        while rest and rest[0] == "super":
            base, rest = base[:-1], rest[1:]
    elif segments[0] == "self":
        base, rest = module, segments[1:]
    elif module + (segments[0],) in known:
        base, rest = module, segments
    else:
        return None
    target = base
    for segment in rest:
        if target + (segment,) in known:
            target = target + (segment,)
        else:
            break
    return target


def edges(known):
    graph = {module: set() for module in known}
    for module, path in known.items():
        with open(path, encoding="utf-8") as file:
            text = STRING.sub('""', COMMENT.sub("", file.read()))
        # Tests are the module's own business, not its dependencies.
        text = text.split("#[cfg(test)]")[0]
        paths = [p for tree in USE.findall(text) for p in expand(tree)]
        paths += PATH.findall(text)
        for used in paths:
            target = resolve(module, used, known)
            if target is not None and target != module and target != () and module != ():
                # A module naming its own descendant is composition, not a dependency back.
                if target[: len(module)] != module:
                    graph[module].add(target)
    return graph


def cycles(graph):
    """Returns the strongly connected components with more than one module."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in graph:
        if node not in index:
            visit(node)
    return found


def name(module):
    return "::".join(module) or "crate"


def main(argv):
    show = "--graph" in argv
    failed = False
    for src in [a for a in argv if not a.startswith("--")]:
        known = modules(src)
        graph = edges(known)
        count = sum(len(targets) for targets in graph.values())
        if show:
            for module in sorted(graph):
                for target in sorted(graph[module]):
                    print(f"{src}: {name(module)} -> {name(target)}")
        found = cycles(graph)
        for component in found:
            failed = True
            print(f"{src}: cycle among {', '.join(sorted(name(m) for m in component))}")
        if not found:
            print(f"{src}: {len(known)} modules, {count} dependencies, no cycles")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
