import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mtp.decoding.tree import Tree


@st.composite
def trees(draw):
    """Random valid path sets: each new path extends an existing one (or the root) by one rank."""
    paths = [()]
    for _ in range(draw(st.integers(0, 24))):
        parent = draw(st.sampled_from(paths))
        if len(parent) < 5:
            paths.append(parent + (draw(st.integers(0, 7)),))
    return [path for path in paths if path]


@settings(max_examples=200, deadline=None)
@given(trees())
def test_tree_invariants(paths):
    tree = Tree.from_paths(paths, num_heads=5, top_k=8)
    index = {(): 0} | {path: i + 1 for i, path in enumerate(tree.paths)}
    assert set(tree.paths) == set(paths) and tree.size == len(index)
    for path, i in index.items():
        ancestors = {index[path[:d]] for d in range(len(path) + 1)}  # itself and every ancestor
        assert set(torch.nonzero(tree.mask[i]).flatten().tolist()) == ancestors
        assert tree.depths[i] == len(path) == tree.mask[i].sum() - 1
        assert tree.parents[i] == (index[path[:-1]] if path else -1)
        assert tree.ranks[i] == (path[-1] if path else -1)
    leaves = [path for path in index if not any(other[:-1] == path for other in index if other)]
    rows = [tuple(i for i in row.tolist() if i >= 0) for row in tree.retrieve]
    expected = [tuple(index[leaf[:d]] for d in range(len(leaf) + 1)) for leaf in leaves]
    assert sorted(rows) == sorted(expected) and len(set(rows)) == len(rows)  # every path exactly once


def test_a_small_tree_by_hand():
    tree = Tree.from_paths([(1,), (0, 0), (0,)])
    assert tree.paths == ((0,), (1,), (0, 0))
    assert tree.parents.tolist() == [-1, 0, 0, 1] and tree.depths.tolist() == [0, 1, 1, 2]
    assert tree.mask.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert tree.retrieve.tolist() == [[0, 2, -1], [0, 1, 3]]


@pytest.mark.parametrize(
    "paths, message",
    [
        ([(0, 0)], r"Path \(0, 0\) has no parent path \(0,\)"),
        ([(0,), (3,)], r"Path \(3,\) has a rank outside 0..2"),
        ([(0,), (0, 0), (0, 0, 0)], r"Path \(0, 0, 0\) is 3 deep, but there are only 2 heads"),
        ([()], "The empty path is the root"),
    ],
)
def test_invalid_trees_are_clear_errors(paths, message):
    with pytest.raises(ValueError, match=message):
        Tree.from_paths(paths, num_heads=2, top_k=3)


def test_named_trees_are_valid_and_sized_as_documented():
    from mtp.decoding.tree import NAMED_TREES, named_tree

    assert {name: named_tree(name, num_heads=4).size for name in NAMED_TREES} == {
        "chain": 5,
        "small": 9,
        "medium": 17,
        "large": 33,
    }
    assert named_tree("large", num_heads=1).paths == ((0,), (1,), (2,), (3,), (4,))  # deeper nodes dropped
    with pytest.raises(ValueError, match="Unknown tree 'huge'"):
        named_tree("huge", num_heads=4)
