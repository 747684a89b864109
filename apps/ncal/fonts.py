"""A CJK font for the NCAL figures, chosen among the fonts installed on this machine.

The TMWPL class names are Chinese. Matplotlib's default font (DejaVu Sans) has no CJK glyphs: drawn with it they come
out as empty boxes, with the warning ``Glyph ... missing from font(s) DejaVu Sans``. :func:`cjk_family` names the
first installed family of :data:`CJK_FAMILIES`; a figure draws Chinese text with ``["sans-serif", that family]``
(matplotlib takes each glyph from the first family that has it) and, when none is installed, leaves Chinese out.
On Debian: ``apt-get install fonts-noto-cjk`` (``.ci/run`` installs it).
"""

from __future__ import annotations

import functools
import logging
import os

logger = logging.getLogger(__name__)

__all__ = ["CJK_FAMILIES", "cjk_family", "text_family"]

#: Simplified-Chinese-capable families, most preferred first; only installed ones are used.
CJK_FAMILIES = (
    "Noto Sans CJK SC",  # Debian fonts-noto-cjk
    "Noto Sans CJK JP",  # the same package's first face, should a font list hold only that one
    "Noto Sans SC",
    "Source Han Sans SC",
    "WenQuanYi Zen Hei",  # Debian fonts-wqy-zenhei
    "WenQuanYi Micro Hei",  # Debian fonts-wqy-microhei
    "Droid Sans Fallback",  # Debian fonts-droid-fallback
    "AR PL UMing CN",  # Debian fonts-arphic-uming
    "Microsoft YaHei",  # Windows
    "SimHei",  # Windows
    "PingFang SC",  # macOS
    "Heiti SC",  # macOS
)
# Parts of the file names of the fonts above (lower case, without "-" and "_"), to find ones matplotlib has not listed.
_CJK_FILE_HINTS = ("cjk", "notosanssc", "sourcehan", "wqy", "droidsansfallback", "uming", "msyh", "simhei", "pingfang")


def _first_installed(font_manager) -> str | None:
    names = {f.name for f in font_manager.fontManager.ttflist}
    return next((f for f in CJK_FAMILIES if f in names), None)


@functools.cache
def cjk_family() -> str | None:
    """The first family of :data:`CJK_FAMILIES` that matplotlib can draw with here, or None."""
    from matplotlib import font_manager

    found = _first_installed(font_manager)
    if found is None:
        # Matplotlib keeps its font list in a cache file written when it first ran: a CJK font installed since is
        # missing from it. Add such fonts from the system's font files (what a fresh cache would hold).
        known = {os.path.realpath(f.fname) for f in font_manager.fontManager.ttflist}
        for path in font_manager.findSystemFonts():
            stem = os.path.basename(path).lower().replace("-", "").replace("_", "")
            if any(h in stem for h in _CJK_FILE_HINTS) and os.path.realpath(path) not in known:
                try:
                    font_manager.fontManager.addfont(path)
                except (OSError, RuntimeError) as err:  # an unreadable font file: skip it
                    logger.debug("cannot read font %s: %s", path, err)
        found = _first_installed(font_manager)
    logger.debug("CJK font for figures: %s", found)
    return found


def text_family(text: str) -> list[str] | None:
    """Font families for a matplotlib text holding ``text``: the default sans-serif, then the CJK family for the
    glyphs it lacks; None (matplotlib's default) for ASCII text or when no CJK font is installed."""
    family = None if text.isascii() else cjk_family()
    return ["sans-serif", family] if family else None
