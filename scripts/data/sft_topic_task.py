#!/usr/bin/env python3
"""A synthetic instruction task for supervised fine-tuning on the CPU (configs/experiments/
sft_tiny.yaml): is a sentence about sports or music? The answer follows from the sentence's
keyword; held-out questions put the keywords in wordings that training never shows.

    sft_topic_task.py PREFIX     writes PREFIX_train.jsonl (480 conversations, in the
                                 {"messages": [...]} form preprocess --chat reads) and
                                 PREFIX_held_out.jsonl (20 questions with their answers)
    sft_topic_task.py --sentences PREFIX
                                 the same with one training answer in four a sentence
                                 ("sports, I am sure."): the model fine-tuned on it answers bare
                                 topics greedily yet gives the sentences real probability, so
                                 that DPO (--preference) chooses between behaviours the policy
                                 already has, as after a real SFT, instead of creating the
                                 preferred one from log-probabilities near -70
    sft_topic_task.py --swapped PREFIX
                                 the same with the labels swapped (sports answered music and
                                 the other way round): a model tuned on it answers every
                                 held-out question wrong, which LoRA then corrects
                                 (configs/experiments/sft_lora_tiny.yaml)
    sft_topic_task.py --preference PREFIX
                                 preference pairs for DPO after the --sentences fine-tuning
                                 (configs/experiments/dpo_tiny.yaml), in TRL's form: chosen
                                 answers are sentences, "sports, I am sure.", rejected either
                                 the bare topic ("sports") or the sentence with the wrong topic,
                                 each keyword and wording meeting both kinds. PREFIX_pairs.jsonl:
                                 480 pairs of the training wordings, then 20 of the held-out
                                 wordings (split 96,4,0 makes them the validation pairs);
                                 PREFIX_pairs_held_out.jsonl: the 20 held-out questions with the
                                 answer DPO should make greedy generation give
"""
import json
import os
import sys

SPORTS = ["football", "tennis", "soccer", "baseball", "golf", "hockey", "rugby", "cricket", "boxing", "swimming"]
MUSIC = ["piano", "guitar", "violin", "drums", "singing", "opera", "jazz", "concert", "melody", "orchestra"]
TRAIN_WORDINGS = ["I really enjoy {} on weekends.", "My friend talked about {} all day.", "We watched {} last night.",
                  "Nothing beats {} in the summer.", "He wrote a long letter about {}.", "They spent the evening on {}."]
HELD_OUT_WORDINGS = ["Yesterday the topic was {}.", "She has loved {} since childhood."]


def question(sentence):
    return f"Topic of: {sentence} Answer sports or music."


def sentence_answer(label):
    return f"{label}, I am sure."


def preference_pairs(prefix):
    other = {"sports": "music", "music": "sports"}

    # The rejected answer alternates over keywords, wordings and repeats, so that every keyword
    # and wording is met against the wrong topic as well as against the bare answer; a pattern
    # that kept one kind per keyword taught half the keywords' topics nothing in the new style.
    def pair(sentence, label, against_wrong_topic):
        rejected = sentence_answer(other[label]) if against_wrong_topic else label
        return json.dumps({"prompt": [{"role": "user", "content": question(sentence)}],
                           "chosen": [{"role": "assistant", "content": sentence_answer(label)}],
                           "rejected": [{"role": "assistant", "content": rejected}]}) + "\n"

    with open(prefix + "_pairs.jsonl", "w", encoding="utf-8") as out, \
            open(prefix + "_pairs_held_out.jsonl", "w", encoding="utf-8") as held:
        for repeat in range(4):
            for w, wording in enumerate(TRAIN_WORDINGS):
                for words, label in ((SPORTS, "sports"), (MUSIC, "music")):
                    for j, word in enumerate(words):
                        out.write(pair(wording.format(word), label, (repeat + w + j) % 2 == 1))
        for w, wording in enumerate(HELD_OUT_WORDINGS):
            for i in range(0, 10, 2):
                for t, (words, label) in enumerate(((SPORTS, "sports"), (MUSIC, "music"))):
                    out.write(pair(wording.format(words[i]), label, (w + i // 2 + t) % 2 == 1))
                    held.write(json.dumps({"prompt": question(wording.format(words[i])),
                                           "answer": sentence_answer(label)}) + "\n")


def main():
    args = sys.argv[1:]
    if args and not args[-1].startswith("--"):
        # The experiments' commands write under data/, which a fresh clone does not have.
        os.makedirs(os.path.dirname(args[-1]) or ".", exist_ok=True)
    if args[:1] == ["--preference"] and len(args) == 2:
        preference_pairs(args[1])
        return
    swapped, sentences = args[:1] == ["--swapped"], args[:1] == ["--sentences"]
    args = args[1:] if swapped or sentences else args
    if len(args) != 1:
        sys.exit(__doc__)
    prefix = args[0]
    said = {"sports": "music", "music": "sports"} if swapped else {"sports": "sports", "music": "music"}
    with open(prefix + "_train.jsonl", "w", encoding="utf-8") as out:
        k = 0
        for _ in range(4):
            for wording in TRAIN_WORDINGS:
                for words, label in ((SPORTS, "sports"), (MUSIC, "music")):
                    for word in words:
                        answer = sentence_answer(said[label]) if sentences and k % 4 == 3 else said[label]
                        k += 1
                        messages = [{"role": "user", "content": question(wording.format(word))},
                                    {"role": "assistant", "content": answer}]
                        out.write(json.dumps({"messages": messages}) + "\n")
    with open(prefix + "_held_out.jsonl", "w", encoding="utf-8") as out:
        for wording in HELD_OUT_WORDINGS:
            for i in range(0, 10, 2):
                for words, label in ((SPORTS, "sports"), (MUSIC, "music")):
                    out.write(json.dumps({"prompt": question(wording.format(words[i])), "answer": label}) + "\n")


if __name__ == "__main__":
    main()
