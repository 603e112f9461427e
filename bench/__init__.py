"""Benchmarks, run from the repo root; results go to bench/results/.

    python -m bench [case ...] [--quick] [--sizes small,base]   # t5forge vs HF vs CTranslate2
    python -m bench.data_pipeline                               # the data pipeline alone
"""
