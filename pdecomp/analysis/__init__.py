"""Reading a finished decomposition: component statistics and contexts, the HTML report
and its Parquet tables, the analysis gate, export, labels, prompts and the viewer's
server. The top floor."""
