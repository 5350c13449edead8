"""The glossary linker on docutils trees: first use only, never in headings, code or links."""

from __future__ import annotations

from docutils import nodes
from docutils.frontend import get_default_settings
from docutils.parsers.rst import Parser
from docutils.utils import new_document
from sphinx import addnodes

from trainplan.runbook import glossary


def _doc(rst: str) -> nodes.document:
    doc = new_document("<test>", get_default_settings(Parser))
    Parser().parse(rst, doc)
    return doc


def _xrefs(doc) -> list[tuple[str, str]]:
    return [(x["reftarget"], x.astext()) for x in doc.findall(addnodes.pending_xref)]


def test_first_use_of_each_word_is_linked_once():
    doc = _doc("Title with HSDP\n===============\n\nTrain with HSDP over dp16 at 45% MFU; "
               "HSDP again, and a micro-batch of two micro-batches.\n")
    assert glossary.link_first_uses(doc) == ["HSDP", "data parallel", "MFU", "micro-batch"]
    assert _xrefs(doc) == [("HSDP", "HSDP"), ("data parallel", "dp16"), ("MFU", "MFU"),
                           ("micro-batch", "micro-batch")]
    assert doc.astext().count("HSDP") == 3, "no text lost or doubled"
    assert "Title with HSDP" in [t.astext() for t in doc.findall(nodes.title)]


def test_code_links_and_words_inside_words_are_left_alone():
    doc = _doc("Run ``TP2 --zero 3`` and see `HSDP <https://example.invalid>`_ "
               "or MFUs, HSDPs, TP-aware.\n")
    assert glossary.link_first_uses(doc) == []


def test_the_first_config_tag_links_to_how_to_read_one():
    doc = _doc("Compare ``make test``, ``p-z2-mb8`` and ``pp2-fsdp2-1f1b-mb2x8-c``.\n")
    assert glossary.link_first_uses(doc) == ["config tag"]
    assert _xrefs(doc) == [("config tag", "p-z2-mb8")]


def test_a_config_tag_in_prose_links_too():
    doc = _doc("Memory ran 15% over (s13b-1gpu-mb1-l2-c), then ``p-z2-mb8``.\n")
    assert glossary.link_first_uses(doc) == ["config tag"]
    assert _xrefs(doc) == [("config tag", "s13b-1gpu-mb1-l2-c")]


def test_overlapping_forms_keep_the_earlier():
    assert glossary.first_uses("tensor parallel TP2", {"tensor parallel"}) == \
        [(0, 15, "tensor parallel")]
    assert [e for *_, e in glossary.first_uses("FSDP with ZeRO-3", {"FSDP", "ZeRO"})] == \
        ["FSDP", "ZeRO"]


def test_html_tables_link_their_first_use_but_not_inside_links_or_tags():
    doc = _doc("Intro.\n")
    table = ('<table><tr><th title="MFU here">MFU</th><td><a href="x">HSDP</a></td>'
             "<td>HSDP dp16 and MFU</td></tr></table>")
    doc += nodes.raw("", table, format="html")
    linked = glossary.link_first_uses(doc, href=lambda e: f"g.html#{e}")
    html = doc.children[-1].astext()
    assert linked == ["MFU", "HSDP", "data parallel"]
    assert 'title="MFU here"' in html and '<a href="x">HSDP</a>' in html
    assert html.count('href="g.html#HSDP"') == 1 and html.count("g.html#MFU") == 1
    assert glossary.link_first_uses(_doc("MFU.\n")) == ["MFU"], "no href: tables untouched"
