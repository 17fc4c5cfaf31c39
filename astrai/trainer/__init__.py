"""astrai.trainer"""
