"""hsx corpus: what a job reads before any model runs — corpus files into records, chats into token ids and loss
masks, the registry that makes a run exactly once, and the regenerated corpus format.

    records.py         CorpusFile, Record, sample ids and the text rules every reader applies
    readers.py         corpus files -> records (any fsspec URL, globs; a reader per format); bad lines -> failed records
    jsonl.py           the JSONL reader (compressed, JSON arrays, broken streams)
    parquet.py         the Parquet reader (row batches, non-UTF-8 cells)
    regenerated.py     the regenerated corpus (`hsx regenerate`'s OUTPUT), its one owner: regenerate.json, the part
                       writer, orphans; read as records: committed ones only, through its manifest
    chat.py            chat records -> ids + assistant loss mask, for any chat template
    tokenization.py    records -> token ids + loss mask (the CPU stage of a job)
    sample_registry.py SampleRegistry actors: skip committed ids, fail duplicate ids (16 bytes an id, on Ray)

Imports connectors and extractor (chat content parts); Ray only inside sample_registry's functions. The jobs that
read corpora are jobs/ (extraction), regeneration/ and training_jobs/ (--online).
"""
