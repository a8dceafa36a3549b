"""Reports, above derive: formula sheets as a JSON-ready dict printed as Markdown, LaTeX and JSON
(``sheet``), their plots (``plots``), plain-text summaries (``summary``), rich tables (``terminal``), the
seeds' rules of thumb with derived verdicts (``check``), the generated documents (``reference``)."""
