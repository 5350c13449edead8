"""Links each page's first use of a glossary word to book/glossary.md (a Sphinx extension).

The runbook is read by people who are not systems engineers, so every page links the words
of distributed training to their entry, once, where the page first uses them: typed prose,
glued sentences (the decision boxes, the front page's copy of page 1's decision), figure
captions and the HTML tables of notebook outputs alike, but not headings, code or links.
The first code span that is a config tag (`p-z2-mb8`) links to the entry that says how to
read one. Each link is an ordinary `term` reference, so a word whose entry is missing fails
the strict build (`-n -W`).

Registered in _config.yml (`sphinx.extra_extensions`); tests/book/test_browser.py checks the
built pages with the same table.
"""

from __future__ import annotations

import re

from docutils import nodes

# glossary entry -> the forms a page writes it in (case-sensitive unless (?i) is given)
TERMS: dict[str, str] = {
    "micro-batch": r"(?i:micro-batch(?:es)?)",
    "gradient accumulation": r"(?i:gradient accumulation|accumulat(?:es|ed|ing|ion))",
    "global batch": r"(?i:global batch(?:es)?)",
    "MFU": r"MFU",
    "recompute": r"(?i:recompute[sd]?|recomputing|recomputation)",
    "data parallel": r"(?i:data[- ]parallel(?:ism)?)|dp\d+",
    "DDP": r"DDP",
    "ZeRO": r"ZeRO(?:-[123])?",
    "FSDP": r"FSDP2?",
    "HSDP": r"HSDP",
    "tensor parallel": r"(?i:tensor[- ]parallel(?:ism)?)|TP\d*",
    "pipeline parallel": r"(?i:pipeline[- ]parallel(?:ism)?)|PP\d*",
    "1F1B": r"1F1B",
    "pipeline bubble": r"(?i:(?:pipeline )?bubbles?)",
    "context parallel": r"(?i:context[- ]parallel(?:ism)?)|CP\d*",
    "expert parallel": r"(?i:expert[- ]parallel(?:ism)?)|EP\d*",
    "layout": r"(?i:layout famil(?:y|ies))",
    "collective": r"(?i:all-reduces?|all-gathers?|reduce-scatters?|collectives)|NCCL",
    "proxy": r"(?i:proxy)",
    "layer slice": r"(?i:layer slices?)",
    "validated": r"(?i:validated|not validated)",
    "bf16": r"bf16",
    "config tag": r"(?:p|g8|g13|g70|s13b|s70b)(?:-[a-z0-9]+)+|[a-z0-9]+(?:-[a-z0-9]+)+-c",
}
PATTERNS = {entry: re.compile(rf"(?<![\w-])(?:{form})(?![\w-])") for entry, form in TERMS.items()}
TAG = re.compile(TERMS["config tag"])  # a tag in a code span, matched whole
GLOSSARY_DOC = "book/glossary"
SKIP = (nodes.literal, nodes.literal_block, nodes.reference, nodes.title, nodes.raw,
        nodes.math, nodes.math_block, nodes.target, nodes.term, nodes.FixedTextElement)


def _skipped(node: nodes.Node) -> bool:
    from sphinx import addnodes

    parent = node.parent
    while parent is not None:
        if isinstance(parent, SKIP + (addnodes.pending_xref,)):
            return True
        parent = parent.parent
    return False


def _xref(entry: str, child: nodes.Node):
    from sphinx import addnodes

    ref = addnodes.pending_xref("", refdomain="std", reftype="term", reftarget=entry,
                                refexplicit=True, refwarn=True)
    ref += child
    return ref


def first_uses(text: str, unlinked: set[str]) -> list[tuple[int, int, str]]:
    """(start, end, entry) of the first match in `text` of each entry still unlinked, in order
    of position, overlapping matches dropped (the earlier one wins)."""
    found = sorted((m.start(), m.end(), entry) for entry in unlinked
                   if (m := PATTERNS[entry].search(text)))
    out, end = [], -1
    for start, stop, entry in found:
        if start >= end:
            out.append((start, stop, entry))
            end = stop
    return out


HTML_TEXT = re.compile(r"(?<=>)[^<>]+(?=<)")  # text between tags, not attributes


def _link_html(html: str, unlinked: set[str], href) -> tuple[str, list[str]]:
    """Link the first use of each unlinked entry in a raw HTML output (a pandas table): text
    between tags only, never inside a link."""
    out, at, linked, depth, seen = [], 0, [], 0, 0
    for m in HTML_TEXT.finditer(html):
        between = html[seen:m.start()]  # the tags since the last text: track open links
        depth += len(re.findall(r"<a[\s>]", between)) - between.count("</a>")
        seen = m.end()
        if depth > 0 or not unlinked:
            continue
        text, pieces, cut = m.group(), [], 0
        for start, stop, entry in first_uses(text, unlinked):
            pieces += [text[cut:start], f'<a class="reference internal" href="{href(entry)}">'
                       f'<span class="xref std std-term">{text[start:stop]}</span></a>']
            cut = stop
            unlinked.discard(entry)
            linked.append(entry)
        if pieces:
            out += [html[at:m.start()], "".join(pieces), text[cut:]]
            at = m.end()
    return "".join(out) + html[at:], linked


def link_first_uses(doctree: nodes.document, href=None) -> list[str]:
    """Wrap each term's first use (and the first config-tag code span) in a `term` reference;
    with `href` (entry -> URL of its anchor), HTML tables of notebook outputs too. Return the
    entries linked, in page order."""
    unlinked, linked = set(TERMS), []
    kinds = (nodes.Text, nodes.literal, nodes.raw)
    for node in list(doctree.findall(lambda n: isinstance(n, kinds))):
        if isinstance(node, nodes.raw):
            if href is not None and "html" in node.get("format", "").split() and unlinked:
                html, done = _link_html(node.astext(), unlinked, href)
                if done:
                    node.parent.replace(node, nodes.raw("", html, format="html"))
                    linked += done
            continue
        if isinstance(node, nodes.literal):
            if "config tag" in unlinked and TAG.fullmatch(node.astext()) and not _skipped(node):
                node.parent.replace(node, _xref("config tag", node.deepcopy()))
                unlinked.discard("config tag")
                linked.append("config tag")
            continue
        if not unlinked or _skipped(node):
            continue
        text, pieces, at = str(node), [], 0
        for start, stop, entry in first_uses(text, unlinked):
            pieces += [nodes.Text(text[at:start]),
                       _xref(entry, nodes.inline(text[start:stop], text[start:stop],
                                                 classes=["xref", "std", "std-term"]))]
            at = stop
            unlinked.discard(entry)
            linked.append(entry)
        if pieces:
            pieces.append(nodes.Text(text[at:]))
            node.parent.replace(node, [p for p in pieces if not (isinstance(p, nodes.Text)
                                                                   and not str(p))])
    return linked


def setup(app):
    from sphinx.transforms.post_transforms import SphinxPostTransform

    class LinkGlossaryTerms(SphinxPostTransform):
        """After myst-nb pastes glued values from other notebooks (priority 5), before the
        references are resolved (9 and 10)."""

        default_priority = 7

        def run(self, **kwargs) -> None:
            if self.env.docname == GLOSSARY_DOC:
                return
            std, builder = self.env.get_domain("std"), self.app.builder

            def href(entry: str) -> str:
                docname, anchor = std.objects[("term", entry)][:2]
                return f"{builder.get_relative_uri(self.env.docname, docname)}#{anchor}"

            link_first_uses(self.document, href if builder.format == "html" else None)

    app.add_post_transform(LinkGlossaryTerms)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
