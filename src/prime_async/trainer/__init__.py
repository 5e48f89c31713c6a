"""prime_async.trainer"""
