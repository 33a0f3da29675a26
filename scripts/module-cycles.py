#!/usr/bin/env python3
"""Checks that the modules of a Rust crate depend on each other without cycles.

Usage: module-cycles.py <crate src dir>... [--graph]
       module-cycles.py --self-test

Each `.rs` file is a module (`lib.rs`/`main.rs` the crate root, `x/mod.rs`
the module `x`). A module depends on another when it names it, or an item
in it, in a `use` or in a path (`crate::a::b`, `super::c`, a child `d::e`); a
name a module re-exports (`pub use inner::Item;`, the crate root's too)
counts as a dependency on the module that defines it.
Declaring a child (`mod x;`) is not a dependency, and the crate root, which
declares and composes everything, is left out. Exits 1 and prints each cycle
found; `--graph` prints every edge too.
"""

import os
import re
import sys

USE = re.compile(r"\buse\s+([^;]+);", re.S)
REEXPORT = re.compile(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);", re.S)
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
    """Expands a use tree (`a::{b, c::{d as e}}`) into (path, name) pairs,
    the name being what the path is known as where it is used."""
    tree = re.sub(r"\s+as\s+", "@", tree.strip())
    tree = re.sub(r"\s+", "", tree)
    brace = tree.find("{")
    if brace < 0:
        path, _, alias = tree.partition("@")
        return [(path, alias or path.split("::")[-1])]
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
    found = []
    for item in items:
        if item == "self":
            found.append((prefix.rstrip(":"), prefix.rstrip(":").split("::")[-1]))
        elif item:
            found.extend(expand(prefix + item.replace("@", " as ")))
    return found


def resolve(module, path, known, exports, depth=0):
    """Returns the deepest known module a path names, seen from `module`,
    following re-exports (`pub use inner::Item;`) to the module that defines
    the item."""
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
    for position, segment in enumerate(rest):
        if target + (segment,) in known:
            target = target + (segment,)
            continue
        reexported = exports.get(target, {}).get(segment)
        if reexported is not None and depth < 8:
            tail = "::".join([reexported] + rest[position + 1 :])
            return resolve(target, tail, known, exports, depth + 1) or target
        break
    return target


def source(path):
    """Returns a file's code without comments, strings and its tests."""
    with open(path, encoding="utf-8") as file:
        text = STRING.sub('""', COMMENT.sub("", file.read()))
    # Tests are the module's own business, not its dependencies.
    return text.split("#[cfg(test)]")[0]


def edges(known):
    texts = {module: source(path) for module, path in known.items()}
    exports = {
        module: {alias: path for tree in REEXPORT.findall(text) for path, alias in expand(tree)}
        for module, text in texts.items()
    }
    graph = {module: set() for module in known}
    for module, text in texts.items():
        paths = [p for tree in USE.findall(text) for p, _ in expand(tree)]
        paths += PATH.findall(text)
        for used in paths:
            target = resolve(module, used, known, exports)
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


def self_test():
    """Checks the script on small crates: a cycle through a re-export is
    found, composition and a one-way re-export are not cycles."""
    import tempfile

    def crate(files):
        root = tempfile.mkdtemp()
        for path, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
            with open(os.path.join(root, path), "w", encoding="utf-8") as file:
                file.write(text)
        return cycles(edges(modules(root)))

    through_reexport = crate({
        "lib.rs": "mod hub; mod replicas; pub use hub::Hubs;",
        "hub.rs": "use crate::replicas::Fanout; pub struct Hubs;",
        "replicas/mod.rs": "mod fanout; pub use fanout::Fanout;",
        "replicas/fanout.rs": "pub struct Fanout; fn f(_: crate::Hubs) {}",
    })
    assert [sorted(name(m) for m in c) for c in through_reexport] == [["hub", "replicas::fanout"]], through_reexport
    one_way = crate({
        "lib.rs": "mod a; mod b;",
        "a/mod.rs": "mod inner; pub use inner::{Thing as Renamed, self as x};",
        "a/inner.rs": "use super::Renamed; pub struct Thing;",
        "b.rs": "use crate::a::Renamed; // crate::b\nfn g() { let _ = \"crate::b\"; }",
    })
    assert one_way == [], one_way
    print("module-cycles self-test passed")
    return 0


def main(argv):
    if "--self-test" in argv:
        return self_test()
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
