"""Text-attributed graphs: WordNet and OGB parsers on fixtures, subgraph sampling."""

from __future__ import annotations

import gzip

import pytest
import torch
from torch_geometric.utils import to_undirected

from structattn.data.graphs import read_ogbn_arxiv, read_wordnet_nouns, sample_subgraph

WORDNET = """  1 This software and database is being provided to you, the LICENSEE, by
  2 Princeton University under the following license.
00001740 03 n 01 entity 0 003 ~ 00001930 n 0000 ~ 00002137 n 0000 ~ 04431553 n 0000 | that which is perceived
00001930 03 n 01 physical_entity 0 002 @ 00001740 n 0000 ~ 00002452 n 0000 | an entity that has physical existence
00002452 03 n 02 thing 0 stuff 1 001 @ 00001930 n 0000 | a separate and self-contained entity
09000001 15 n 01 Paris 0 001 @i 00002452 n 0000 | the capital of France
02084071 05 n 02 dog 0 domestic_dog 0 002 @ 00002452 n 0000 ! 99999999 n 0101 | a member of the genus Canis; "the dog barked"
"""


def test_wordnet_parser(tmp_path):
    path = tmp_path / "data.noun"
    path.write_text(WORDNET)
    g = read_wordnet_nouns(path, seed=0)
    assert g.num_nodes == 5 and g.stand_in and "stand-in" in g.source
    assert g.node_texts[2] == "thing, stuff: a separate and self-contained entity"
    assert g.node_texts[4].startswith("dog, domestic dog: a member of the genus Canis")
    assert g.labels.tolist() == [0, 0, 0, 12, 2]  # Tops, Tops, Tops, location, animal
    assert g.label_names[12] == "location" and len(g.label_names) == 26
    # hypernym and instance-hypernym pointers only; the antonym '!' to an unknown synset dropped
    assert sorted(map(tuple, g.edge_index.T.tolist())) == [(1, 0), (2, 1), (3, 2), (4, 2)]
    assert sorted(torch.cat(list(g.splits.values())).tolist()) == list(range(5))
    data = g.to_pyg()
    assert data.num_nodes == 5 and int(data.train_mask.sum()) == len(g.splits["train"])


def test_wordnet_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "data.noun"
    path.write_text(WORDNET + "00003000 05 n 01 cat 0 002 @ 00002452 n\n")
    with pytest.raises(ValueError, match=r"data.noun:8: malformed WordNet data line"):
        read_wordnet_nouns(path)


def _gz(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        f.write(text)


def _ogb_fixture(root):
    _gz(root / "raw" / "edge.csv.gz", "0,1\n1,2\n3,0\n")
    _gz(root / "raw" / "node-label.csv.gz", "4\n0\n4\n1\n")
    _gz(
        root / "mapping" / "nodeidx2paperid.csv.gz",
        "node idx,paper id\n0,9657784\n1,39886162\n2,116214155\n3,121432379\n",
    )
    _gz(
        root / "mapping" / "labelidx2arxivcategeory.csv.gz",
        "label idx,arxiv category\n0,arxiv cs na\n1,arxiv cs mm\n2,arxiv cs lo\n3,arxiv cs cy\n"
        "4,arxiv cs cr\n",
    )
    _gz(root / "split" / "time" / "train.csv.gz", "0\n1\n")
    _gz(root / "split" / "time" / "valid.csv.gz", "2\n")
    _gz(root / "split" / "time" / "test.csv.gz", "3\n")
    tsv = root / "titleabs.tsv"
    tsv.write_text(
        "paper id\ttitle\tabstract\n9657784\tA\tabs a\n39886162\tB\tabs b\n"
        "116214155\tC\tabs c\n121432379\tD\tabs d\n"
    )
    return tsv


def test_ogbn_arxiv_layout(tmp_path):
    tsv = _ogb_fixture(tmp_path / "ogbn_arxiv")
    g = read_ogbn_arxiv(tmp_path / "ogbn_arxiv", tsv)
    assert not g.stand_in and g.num_nodes == 4
    assert g.node_texts[2] == "C. abs c" and g.node_ids[3] == "121432379"
    assert g.labels.tolist() == [4, 0, 4, 1] and g.label_names[4] == "cs.cr"
    assert g.edge_index.tolist() == [[0, 1, 3], [1, 2, 0]]
    assert {k: v.tolist() for k, v in g.splits.items()} == {
        "train": [0, 1],
        "val": [2],
        "test": [3],
    }


def test_ogbn_arxiv_errors_name_the_file(tmp_path):
    root = tmp_path / "ogbn_arxiv"
    tsv = _ogb_fixture(root)
    _gz(root / "raw" / "node-label.csv.gz", "4\nzero\n4\n1\n")
    with pytest.raises(ValueError, match=r"node-label.csv.gz:2: expected integers"):
        read_ogbn_arxiv(root, tsv)
    _ogb_fixture(root)
    tsv.write_text("paper id\ttitle\tabstract\n9657784\tA\tabs a\n")
    with pytest.raises(ValueError, match="no title/abstract for paper 39886162"):
        read_ogbn_arxiv(root, tsv)


def test_sampling_respects_cap_contains_target_and_keeps_real_edges(tmp_path):
    path = tmp_path / "data.noun"
    path.write_text(WORDNET)
    g = read_wordnet_nouns(path)
    undirected = set(map(tuple, to_undirected(g.edge_index).T.tolist()))
    for target in range(5):
        for cap in (1, 2, 3, 5):
            nodes, edges = sample_subgraph(g, target, num_hops=2, max_nodes=cap, seed=1)
            assert (
                nodes[0] == target and len(nodes) <= cap and len(set(nodes.tolist())) == len(nodes)
            )
            for a, b in edges.T.tolist():
                assert (int(nodes[a]), int(nodes[b])) in undirected
    a = sample_subgraph(g, 2, max_nodes=3, seed=4)
    b = sample_subgraph(g, 2, max_nodes=3, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # seeded
    near, _ = sample_subgraph(g, 4, num_hops=2, max_nodes=2, seed=0)
    assert near.tolist() == [4, 2]  # the 1-hop neighbour before any 2-hop one


def _reference_sample(graph, target, num_hops, max_nodes, seed):
    """The k-hop sampler written with PyG's whole-graph utilities (the readable reference)."""
    from torch_geometric.utils import k_hop_subgraph, subgraph

    undirected = to_undirected(graph.edge_index, num_nodes=graph.num_nodes)
    chosen, seen = [target], {target}
    g = torch.Generator().manual_seed(seed * 1_000_003 + target)
    for hop in range(1, num_hops + 1):
        if len(chosen) >= max_nodes:
            break
        ring, _, _, _ = k_hop_subgraph(target, hop, undirected, num_nodes=graph.num_nodes)
        new = [int(v) for v in ring if int(v) not in seen]
        order = torch.randperm(len(new), generator=g).tolist()
        for i in order[: max_nodes - len(chosen)]:
            chosen.append(new[i])
            seen.add(new[i])
    nodes = torch.tensor(chosen)
    edge_index, _ = subgraph(nodes, undirected, relabel_nodes=False, num_nodes=graph.num_nodes)
    local = torch.full((graph.num_nodes,), -1, dtype=torch.long)
    local[nodes] = torch.arange(len(nodes))
    return nodes, local[edge_index]


def test_csr_sampler_equals_the_whole_graph_reference():
    from structattn.data.graphs import TextAttributedGraph

    gen = torch.Generator().manual_seed(0)
    n = 60
    edges = torch.randint(0, n, (2, 140), generator=gen)  # duplicates and self-loops included
    graph = TextAttributedGraph(
        name="random",
        node_texts=[f"node {i}" for i in range(n)],
        labels=torch.zeros(n, dtype=torch.long),
        label_names=["a"],
        edge_index=edges,
        splits={"train": torch.arange(n)},
        source="random",
        stand_in=True,
    )
    for target in range(0, n, 3):
        for hops, cap, seed in ((1, 4, 0), (2, 16, 1), (3, 40, 2), (2, 1, 3), (4, 100, 4)):
            got = sample_subgraph(graph, target, num_hops=hops, max_nodes=cap, seed=seed)
            ref = _reference_sample(graph, target, hops, cap, seed)
            assert torch.equal(got[0], ref[0]), (target, hops, cap)
            assert torch.equal(got[1], ref[1]), (target, hops, cap)
    # the index is built once and reused, and rebuilt when the edges change
    first = graph._csr
    sample_subgraph(graph, 0)
    assert graph._csr is first
    graph.edge_index = edges[:, :10]
    nodes, _ = sample_subgraph(graph, 0, num_hops=3, max_nodes=100)
    assert torch.equal(nodes, _reference_sample(graph, 0, 3, 100, 0)[0])
