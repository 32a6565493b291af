"""The sentiment miniature's labeler: VADER (Hutto & Gilbert 2014, the `vaderSentiment` package, MIT), a
published rule-based sentiment model with its own lexicon, that nobody here wrote. It plays the paper's
sentiment labelers, who picked the most positive of four continuations: the most positive response is the
one with the highest compound score (in [-1, 1]; ties broken at random by the labels' maker)."""

import functools


@functools.lru_cache(maxsize=None)
def _analyzer():
    try:  # lazily: only the sentiment miniature needs it
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
    except ImportError:
        raise ImportError("the sentiment miniature's labeler is VADER, which is not installed: "
                          "pip install vaderSentiment (it is in requirements.txt)") from None
    return SentimentIntensityAnalyzer()


def compound_score(text):
    """VADER's compound sentiment score of text: -1 (most negative) to 1 (most positive), 0 neutral."""
    return _analyzer().polarity_scores(text)['compound']
